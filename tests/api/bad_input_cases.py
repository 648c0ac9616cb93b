"""The bad-input table of `diloco train --model/--loss/--optimizer` and the data: each case and how to run it.

Shared by tests/api/test_bad_input.py (which asserts each one) and, run as a script, the generator of
docs/bad-input.md, which runs every case through the real CLI and prints the markdown table:

    python -m tests.api.bad_input_cases > docs/bad-input.md

Each case is what a user types: CLI arguments, with ``{name}`` standing for a file of :func:`write_datasets`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
B = "tests.api.bad_models:"

# Runs `python -m orchestrator.cli` with Ray made unimportable: a refusal that arrives with exit code 2,
# not an ImportError traceback, was decided before Ray was imported, let alone started.
NO_RAY_CLI = """
import runpy, sys
sys.modules["ray"] = None
sys.argv[0] = "diloco"
runpy.run_module("orchestrator.cli", run_name="__main__")
"""

# Lines `diloco train` prints on stderr before the checks that need torch: the emulation note of the default
# two-pool config and the first start-up stage (orchestrator/cli/train.py, ProgressBar).
LEADING = ("EMULATION:", "start-up ")


@dataclass(frozen=True)
class Case:
    """One bad input: `what` (the table's words), the CLI `args`, the substring of the message that names the
    fix, and whether the test also runs it through the CLI in a subprocess (`cli`: one case of each kind, an
    import path, the user's code raising, a loss, the data; about 3 s each on an idle 2-core machine, so
    not all of them). The table's generator runs every case through the CLI."""

    id: str
    what: str
    args: tuple[str, ...]
    fix: str
    cli: bool = False


def tokens(name: str, *extra: str) -> tuple[str, ...]:
    """Arguments that train on the uint16 token files at `name` (see write_datasets), vocabulary 256."""
    return ("--set", "data.source=tokens", "--set", f"data.path={{{name}}}", "--set", "data.vocab_size=256", *extra)


def parquet(name: str, *extra: str) -> tuple[str, ...]:
    """Arguments that train on the text column of dataset file `name` (see write_datasets)."""
    return ("--set", "data.source=parquet", "--set", f"data.path={{{name}}}", "--set", "data.text_column=text", *extra)


CASES = [
    Case("module-missing", "`--model` whose module does not import", ("--model", "nosuch_pkg.models:build"),
         "check the spelling and that the package is installed or on PYTHONPATH", cli=True),
    Case("attribute-missing", "`--model` whose function is not in the module", ("--model", B + "tiny_llm"),
         "did you mean 'tiny_lm'"),
    Case("optimizer-misspelt", "`--optimizer` misspelt", ("--model", B + "tiny_lm", "--optimizer", "torch.optim:Adamw"),
         "did you mean 'AdamW'?"),
    Case("not-callable", "`--model` naming a value, not a function", ("--model", B + "NOT_CALLABLE"),
         "point it at a function"),
    Case("not-a-path", "`--model` without `:function`", ("--model", "tests.api.bad_models"),
         "write it as 'package.module:function'"),
    Case("factory-raises", "a factory that raises (here RuntimeError)", ("--model", B + "raises"),
         "fix the factory", cli=True),
    Case("factory-needs-arguments", "a factory that needs arguments", ("--model", B + "needs_arguments"),
         "it is called with no arguments"),
    Case("not-a-module", "a factory that returns a dict, not an `nn.Module`", ("--model", B + "returns_dict"),
         "make it return the model itself"),
    Case("no-trainable-parameters", "a model with no trainable parameters", ("--model", B + "frozen"),
         "requires_grad=True"),
    Case("model-rejects-batches", "a model that cannot take the data's batches (an image CNN on tokens)",
         ("--model", B + "image_model"), "make the model and loss take this data's batches"),
    Case("loss-vector", "`--loss` returning a vector", ("--model", B + "tiny_lm", "--loss", B + "vector_loss"),
         "return e.g. loss.mean()", cli=True),
    Case("loss-float", "`--loss` returning a Python float", ("--model", B + "tiny_lm", "--loss", B + "float_loss"),
         "return the loss tensor itself"),
    Case("optimizer-not-optimizer", "`--optimizer` returning a dict",
         ("--model", B + "tiny_lm", "--optimizer", B + "not_an_optimizer"), "make it return e.g. torch.optim.AdamW"),
    Case("outer-optimizer-not-optimizer", "`outer.optimizer` returning a dict",
         ("--model", B + "tiny_lm", "--set", "outer.optimizer=" + B + "not_an_optimizer"),
         "make it return e.g. torch.optim.Adam"),
    Case("vocab-too-small", "token ids past the model's vocabulary (`nn.Embedding(100, ...)`, byte corpus)",
         ("--model", B + "small_vocab"), "build the model with a vocabulary of at least"),
    Case("dataset-empty", "an empty Parquet dataset", parquet("empty"), "point at a non-empty dataset"),
    Case("dataset-few-bytes", "a Parquet text corpus of 2 bytes", parquet("few_bytes"), "add rows"),
    Case("dataset-too-small-for-islands", "a token-file corpus too small for 4 islands (400 ids, 80 per unit)",
         tokens("tokens_tiny"), "train fewer islands (pools.NAME.islands)", cli=True),
    Case("path-without-source", "`data.path` with the default source (stdlib), which would not read it",
         ("--set", "data.path={tokens}"), "set data.source=parquet (or tokens for token files), or drop data.path"),
    Case("inert-block-size", "a wire-format option with no wire format that uses it (one of a class: docs/config.md)",
         ("--set", "outer.compression_block_size=128"), "use int8, int4, int2 or sign for one of them, or drop "
                                                         "outer.compression_block_size"),
    Case("tokens-no-files", "`data.source=tokens` at a folder with no token files", tokens("no_token_files"),
         "point at the directory that holds them"),
    Case("tokens-odd-size", "a token file whose size is not a whole number of uint16 ids", tokens("odd_size"),
         "fix it or set data.token_dtype"),
    Case("tokens-no-vocab", "token files without `data.vocab_size`",
         ("--set", "data.source=tokens", "--set", "data.path={tokens}"), "set it to the vocabulary of the tokenizer"),
    Case("copy-differs", "`pools.NAME.data_path` that is not a copy of `data.path`",
         tokens("tokens", "--set", "pools.slow.data_path={tokens_short}"), "copy the same files there"),
    Case("storage-unreachable", "an `s3://` corpus whose endpoint does not answer",
         tokens("s3_closed"), "check the endpoint"),
]


def write_datasets(folder: Path) -> dict[str, str]:
    """The Parquet and token files the cases name, written under `folder` (and one unreachable URI): {name: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    tables = {"empty": pa.table({"text": pa.array([], pa.string())}),
              "few_bytes": pa.table({"text": ["ab"]}),
              }
    paths = {}
    for name, table in tables.items():
        paths[name] = str(folder / f"{name}.parquet")
        pq.write_table(table, paths[name])
    import numpy as np

    ids = (np.arange(300_000) % 256).astype("<u2")
    for name, count in (("tokens", len(ids)), ("tokens_short", len(ids) - 4096)):  # the copy lacks a few ids
        (folder / name).mkdir(exist_ok=True)
        ids[:count].tofile(folder / name / "train.bin")
        paths[name] = str(folder / name)
    (folder / "tokens_tiny").mkdir(exist_ok=True)
    ids[:400].tofile(folder / "tokens_tiny" / "train.bin")
    paths["tokens_tiny"] = str(folder / "tokens_tiny")
    (folder / "no_token_files").mkdir(exist_ok=True)
    (folder / "no_token_files" / "README.md").write_text("the token files are elsewhere\n")
    paths["no_token_files"] = str(folder / "no_token_files")
    (folder / "odd_size.bin").write_bytes(b"\x01\x00\x02")  # one id and a half
    paths["odd_size"] = str(folder / "odd_size.bin")
    # Port 9 (discard) answers nothing here: the S3 client's connection is refused.
    paths["s3_closed"] = "s3://corpus/tokens?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
    return paths


def cli_args(case: Case, datasets: dict[str, str], run_dir: Path) -> list[str]:
    """`diloco train` arguments of `case`, its files filled in, writing (if it ever did) to `run_dir`."""
    return ["train", "--run-dir", str(run_dir), *(a.format(**datasets) for a in case.args)]


def run_cli(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m orchestrator.cli ARGS` with Ray unimportable, from the repository root: (result, seconds)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", NO_RAY_CLI, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    return done, time.monotonic() - started


def error_lines(stderr: str) -> list[str]:
    """stderr without the lines the CLI prints before its torch checks (LEADING)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(LEADING)]


def in_process_error(case: Case, datasets: dict[str, str], run_dir: Path) -> str:
    """The ConfigError text `case` raises through the CLI's own steps, in this process: parse the arguments,
    build the config (--set, then --model/--loss/--optimizer), preflight, prepare."""
    from orchestrator.cli.main import build_parser
    from orchestrator.cli.train import with_model_flags
    from orchestrator.config import ConfigError, load_config
    from orchestrator.run.preflight import preflight
    from orchestrator.run.workload import prepare

    args = build_parser("train").parse_args(cli_args(case, datasets, run_dir))
    try:
        cfg = with_model_flags(load_config(None, args.set), args)
        preflight(cfg, run_dir)
        prepare(cfg, run_dir=run_dir)
    except ConfigError as err:
        return str(err)
    raise AssertionError(f"{case.id}: no ConfigError")


def shorten(text: str, limit: int = 230) -> str:
    """`text` within about `limit` characters: the fix (after the last "; ") whole, what is wrong cut with …."""
    if len(text) <= limit or "; " not in text:
        return text
    what, fix = text.rsplit("; ", 1)
    keep = max(100, limit - len(fix) - 3)
    return (what if len(what) <= keep else what[: keep - 1].rstrip() + "…") + "; " + fix


def table() -> str:
    """docs/bad-input.md: every case run through the CLI now, its message as printed."""
    import tempfile

    rows = ["| input | message (verbatim, after `diloco train: `) | exit code |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        datasets = write_datasets(Path(tmp) / "data")
        for case in CASES:
            done, _ = run_cli(cli_args(case, datasets, Path(tmp) / "run"))
            lines = error_lines(done.stderr)
            if len(lines) != 1 or (Path(tmp) / "run").exists():
                raise SystemExit(f"{case.id}: expected one line and no run directory, got {done.stderr!r}")
            message = lines[0].removeprefix("diloco train: ").replace(tmp, "/tmp/…").replace("|", "\\|")
            rows.append(f"| {case.what} | `{shorten(message)}` | {done.returncode} |")
    return "\n".join(rows)


HEADER = """# Bad input to `diloco train`: one line, exit code 2, before Ray starts

`diloco train` builds the model, indexes the corpus from its metadata (and every pool's copy of it) and
scores a held-out batch before it imports Ray and before it creates the run directory
(`orchestrator/run/workload.py`, `prepare`). Each input below is refused with one
line on stderr that says what is wrong and how to fix it, exit code 2, and no `--run-dir` left behind.
The same checks run for the Python API (`DilocoTrainer.fit()` raises the same text as a `ConfigError`).
Config mistakes refused even earlier, before torch loads (a missing file or column, a bad preset, an
unknown region), are tested in `tests/engine/test_preflight.py`.

Produced by `python -m tests.api.bad_input_cases > docs/bad-input.md`, which runs each case of
`tests/api/bad_input_cases.py` through `python -m orchestrator.cli train` with Ray made unimportable
(so the refusal cannot have come after a Ray start) and copies the message it printed. A long message
keeps its fix (after the last `; `) whole and is shortened with … before it. The models, losses and
optimizers are in `tests/api/bad_models.py`; the temporary data folder shows as `/tmp/…`.
`tests/api/test_bad_input.py` asserts every row (exit code, one line, the fix, no run directory).

"""

if __name__ == "__main__":
    print(HEADER + table())
