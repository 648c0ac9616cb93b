"""The README's "Train your own model" example runs as written, and so do `diloco sample`, `evaluate`, `export` on its run.

The example is the first ```python block under the heading "## Train your own model" of README.md. It
runs in a fresh Python process, in an empty directory, with no DILOCO_RAY_ADDRESS: like a user's
script, it starts its own local Ray inside fit() and stops it. The test asserts it exits 0, shows its
start-up and progress (fit()'s default), and prints its held-out loss falling from the starting point, to
below a uniform guess over bytes (ln 256 = 5.55 nats). Then, from the same directory, as a user would,
`diloco sample`, `diloco evaluate` and `diloco export` (the CLI's `main`, in this process) read its run
directory: its model is the script's `make_model`, which config.yaml records by the script's module.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADING = "## Train your own model"
SOURCES = (REPO / "README.md",)
LOSS_LINE = re.compile(r"^held-out loss (\d+\.\d+) -> (\d+\.\d+) nats/byte", re.MULTILINE)
TIMEOUT_S = 300  # generous for a loaded 2-core box; about a minute when it is quiet


def section(markdown: str, heading: str) -> str | None:
    """The text under the line ``heading`` up to the next heading of the same or a higher level; None without it."""
    lines = markdown.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    except StopIteration:
        return None
    level = len(heading) - len(heading.lstrip("#"))
    body = []
    in_fence = False
    for line in lines[start + 1:]:
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(rf"#{{1,{level}}} ", line):  # a "# comment" inside code is no heading
            break
        body.append(line)
    return "\n".join(body)


def first_python_block(text: str) -> str | None:
    """The code of the first ```python fenced block of ``text``, or None."""
    match = re.search(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL)
    return match.group(1) if match else None


def example(sources: tuple[Path, ...] = SOURCES) -> tuple[str, Path]:
    """(the example's code, the file it came from): the first of `sources` with the heading."""
    for doc in sources:
        body = section(doc.read_text(encoding="utf-8"), HEADING)
        if body is not None:
            code = first_python_block(body)
            assert code, f"{doc.name} has the heading {HEADING!r} but no ```python block under it"
            return code, doc
    raise AssertionError(f"neither {' nor '.join(d.name for d in sources)} has the heading {HEADING!r}")


def test_the_extraction_finds_the_first_python_block_under_the_heading():
    """Cheap: the rules the example's source follows, on a made-up README."""
    readme = "\n".join([
        "# project", "```python", "print('not this one')", "```",
        HEADING, "Some words.", "```bash", "pip install x", "```",
        "```python", "# a comment, not a heading", "print('this one')", "```",
        "```python", "print('nor this one')", "```",
        "## Next section", "```python", "print('not this either')", "```",
    ])
    assert first_python_block(section(readme, HEADING)) == "# a comment, not a heading\nprint('this one')\n"
    assert section("# project\n## Other\n", HEADING) is None
    assert first_python_block(section(HEADING + "\ntext only\n## Next\n```python\nx = 1\n```\n", HEADING)) is None


def test_the_example_is_short_and_compiles():
    """Cheap, without Ray: the example is about 20 lines of valid Python that prints the loss line."""
    code, doc = example()
    compile(code, str(doc), "exec")
    assert len(code.strip().splitlines()) <= 30, f"the example in {doc.name} is meant to be about 20 lines"
    assert "held-out loss" in code and ".fit()" in code


# Extended: the example's Llama makes each of its five processes import transformers (about 27 s of start-up), 70-100 s
# of CI's serial Ray tests on a slow day. In the default run: the two tests above (its code compiles and prints the
# loss line), notebook 05 (a Hugging Face Llama through fit() on two pools), test_quickstart (sample, evaluate and
# export on a run directory) and tests/api/test_export.py (a Hugging Face model exported and reloaded).
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.extended
def test_the_example_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    code, doc = example()
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_RAY_ADDRESS"}  # its own local Ray, not a cluster
    env["RAY_AUTH_MODE"] = "disabled"  # as the suite runs; a user's machine may leave it unset
    # The child (and the Ray workers it starts) import this checkout, whether or not it is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    print(f"the example from {doc.name} ran in {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, f"the example from {doc.name} failed:\n{done.stderr[-3000:]}"
    found = LOSS_LINE.findall(done.stdout)
    assert found, f"no 'held-out loss A -> B nats/byte' line in its output:\n{done.stdout[-2000:]}"
    first, last = map(float, found[-1])
    assert last < first - 0.5 and last < math.log(256) - 0.5, f"the example's Llama barely learned: {first} -> {last}"
    assert (tmp_path / "runs").is_dir(), "its run directory is relative to where it runs"
    assert re.search(r"^start-up .*starting a local Ray$", done.stderr, re.MULTILINE), done.stderr[-2000:]
    assert re.search(r"^progress 100% .* \| bits/byte: train \d+\.\d+, held-out \d+\.\d+ \|",
                     done.stderr, re.MULTILINE), f"fit() shows its progress by default:\n{done.stderr[-2000:]}"
    the_cli_reads_its_run_directory(tmp_path, last, monkeypatch, capsys)


def the_cli_reads_its_run_directory(cwd: Path, final_loss: float, monkeypatch, capsys) -> None:
    """`diloco sample`, `evaluate` and `export` on the example's run directory, from its directory.

    In this process, through the CLI's own `main` (what the `diloco` console script calls), one after the other:
    three fresh interpreters importing torch and transformers cost about 50 s of CI's serial Ray group, and what
    the test is after is how the commands find the model the run recorded (`example:make_model`), which the
    console script resolves the same way: from the working directory (orchestrator.cli.model.import_from_cwd)."""
    import torch
    import yaml

    from orchestrator.cli.main import main as diloco

    run = "runs/my-llama"
    assert yaml.safe_load((cwd / run / "config.yaml").read_text())["model"]["factory"] == "example:make_model"
    commands = {"sample": ["sample", run, "--prompt", "def ", "--bytes", "40"], "evaluate": ["evaluate", run],
                "export": ["export", run, "--out", "model.pt"]}
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(cwd))])  # as the console script's
    monkeypatch.delitem(sys.modules, "example", raising=False)
    start = time.monotonic()
    out = {}
    capsys.readouterr()
    for name, args in commands.items():
        code = diloco(args)
        got = capsys.readouterr()
        assert code == 0, f"diloco {name} {run} failed:\n{got.err[-2000:]}"
        out[name] = got.out
    sys.modules.pop("example", None)  # the example's module, imported from tmp_path by the commands
    print(f"diloco sample, evaluate and export ran in {time.monotonic() - start:.1f} s")
    assert out["sample"].startswith("def ") and len(out["sample"]) > len("def \n")
    # The last checkpoint is the model the run's final evaluation scored, on the same held-out windows.
    scored = re.search(r"^held-out loss (\d+\.\d+) nats/byte", out["evaluate"], re.MULTILINE)
    assert scored and float(scored.group(1)) == pytest.approx(final_loss, abs=2e-3), out["evaluate"]
    payload = torch.load(cwd / "model.pt", weights_only=True)
    assert payload["factory"] == "example:make_model" and payload["state_dict"], sorted(payload)
