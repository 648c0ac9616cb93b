"""`diloco sample`, `diloco evaluate` and `diloco export`: a finished run's trained model
(orchestrator.run.trained) from the command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

# orchestrator.run.trained and islands.sampling import torch: loaded by the commands that use them, so
# that building the `diloco` parser (for `diloco train` too) stays light.
if TYPE_CHECKING:
    from orchestrator.run.trained import TrainedModel


def _describe(run_dir: str, t: TrainedModel) -> str:
    tokens = f", {t.tokens_processed / 1e6:.2f}M tokens processed" if t.tokens_processed is not None else ""
    versions = f", versions {t.versions}" if t.versions is not None else ""
    which = ", moving average" if t.averaged else ""
    return f"{run_dir}: checkpoint {t.step} ({t.mode}{versions}{tokens}{which})"


def import_from_cwd() -> None:
    """Let a model of the current directory import, as `diloco train --model` does: the console script's path lacks
    it (`python -m` has it). Appended, so a local file never shadows an installed package."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def _load(args: argparse.Namespace) -> TrainedModel:
    from orchestrator.run.trained import load_trained

    import_from_cwd()  # the run's recorded factory and --model alike
    return load_trained(args.run_dir, step=args.step, raw=args.raw, model=args.model)


def _cmd_sample(args: argparse.Namespace) -> int:
    from islands.sampling import sample_text
    from orchestrator.run.trained import TrainedModelError, run_text_codec

    try:
        trained = _load(args)
        if not args.prompt:
            raise TrainedModelError("--prompt is empty; give some text to continue, e.g. --prompt 'def '")
        # Bytes unless the run kept a tokenizer; the model's own context window, else the run's seq_len.
        text = sample_text(trained.model, args.prompt, max_new_tokens=args.bytes, codec=run_text_codec(args.run_dir),
                           temperature=args.temperature, top_k=args.top_k, seed=args.seed, context=trained.seq_len)
    except (TrainedModelError, ValueError) as err:  # ValueError: islands.sampling's argument and model checks
        print(f"diloco sample: {err}", file=sys.stderr)
        return 2
    print(_describe(args.run_dir, trained), file=sys.stderr)
    sys.stdout.write(text + "\n")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from orchestrator.run.trained import TrainedModelError, evaluate_trained

    try:
        trained = _load(args)
        got = evaluate_trained(trained, args.set, loss=args.loss)
    except TrainedModelError as err:
        print(f"diloco evaluate: {err}", file=sys.stderr)
        return 2
    print(_describe(args.run_dir, trained))
    unit = got["unit"]  # "byte" for byte-level text, as the README and `diloco train` say; else "token"
    print(f"held-out loss {got['eval_loss']:.4f} nats/{unit}, {got['eval_bits_per_token']:.3f} bits/{unit} over "
          f"{got['tokens']:,} {unit}s of {got['source']}")
    print(f"unigram model of the same data: {got['unigram_bits_per_token']:.3f} bits/{unit}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from orchestrator.run.trained import TrainedModelError, export_model

    try:
        trained = _load(args)
        path = export_model(trained, args.out, format=args.format, overwrite=args.force)
    except TrainedModelError as err:
        print(f"diloco export: {err}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in trained.model.parameters())  # a tied weight counts once
    what = " (Hugging Face folder)" if args.format == "hf" else ""  # a torch file's line stays as it always was
    print(f"{path}: {n:,} parameters{what} from {_describe(args.run_dir, trained)}")
    return 0


def _run_dir_command(subparsers, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand that reads one checkpoint of RUN_DIR: the positional RUN_DIR, --step, --raw and --model."""
    p = subparsers.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by `diloco train` or `diloco baseline-dp`")
    p.add_argument("--step", type=int, default=None, help="checkpoint number (default: the newest)")
    p.add_argument("--raw", action="store_true",
                   help="the raw global model, not the moving average a run with run.average_window serves")
    p.add_argument("--model", metavar="PACKAGE.MODULE:FUNCTION",
                   help="the function of no arguments that builds the run's model, in place of the one RUN_DIR's "
                        "config.yaml records (e.g. for a model defined in a notebook); the current directory and "
                        "PYTHONPATH are searched, as for `diloco train --model`")
    return p


def register(subparsers) -> None:
    """Add `sample`, `evaluate` and `export` to the `diloco` parser's subparsers."""
    s = _run_dir_command(
        subparsers, "sample", help="continue a prompt with a run's trained model",
        description="Load the newest checkpoint of RUN_DIR (or --step) into the run's model (the built-in one or any "
                    "causal LM, e.g. a Hugging Face one) and continue the prompt token by token: byte by byte, unless "
                    "the run kept a tokenizer (RUN_DIR/tokenizer.json).\n\nExamples:\n"
                    "  diloco sample runs/demo --prompt 'def ' --bytes 300 --temperature 0.8\n"
                    "  diloco sample runs/mine --model mymodels:build   # a model defined in a notebook: its module")
    s.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    s.add_argument("--bytes", "--tokens", dest="bytes", type=int, default=200,
                   help="how many tokens (bytes, for a byte-level run) to generate (default 200)")
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy, 1 = the model's distribution (default 0.8)")
    s.add_argument("--top-k", type=int, default=None, help="draw only among the K likeliest bytes")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    s.set_defaults(func=_cmd_sample)
    v = _run_dir_command(
        subparsers, "evaluate", help="held-out loss of a run's trained model, on its own data or another corpus",
        description="Score the model of RUN_DIR's newest checkpoint (or --step) on held-out windows: the run's own "
                    "held-out data, or what --set data.* names (eval.* sets how many windows).\n\nExamples:\n"
                    "  diloco evaluate runs/demo\n"
                    "  diloco evaluate runs/demo --set data.source=parquet --set data.path=my.parquet --set eval.batches=64")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a data.* or eval.* field to change (repeatable)")
    v.add_argument("--loss", metavar="PACKAGE.MODULE:FUNCTION",
                   help="loss(model, batch) -> scalar tensor, in place of the one RUN_DIR's config.yaml records")
    v.set_defaults(func=_cmd_evaluate)
    e = _run_dir_command(
        subparsers, "export", help="write a run's trained model as a PyTorch file or a Hugging Face folder",
        description="Write the model of RUN_DIR's newest checkpoint (or --step).\n\n"
                    "--format torch (default): one PyTorch file, a dict with the model's state dict and how to rebuild "
                    "it (the built-in model's shape, or a user model's factory import path), read back by "
                    "torch.load(path, weights_only=True) or orchestrator.run.trained.load_exported(path).\n"
                    "--format hf: a Hugging Face folder (save_pretrained, safetensors) for a transformers model, read "
                    "back by AutoModelForCausalLM.from_pretrained(folder); the run's tokenizer goes with it.\n\n"
                    "Examples:\n  diloco export runs/demo --out demo.pt\n"
                    "  diloco export runs/gpt2 --out gpt2-trained --format hf")
    e.add_argument("--out", required=True, metavar="PATH",
                   help="where to write the model: a file (model.pt) for torch, a folder for hf")
    e.add_argument("--format", choices=("torch", "hf"), default="torch",
                   help="torch: one PyTorch file (default); hf: a Hugging Face folder (transformers models only)")
    e.add_argument("--force", action="store_true", help="overwrite PATH if it exists (a folder only if it holds a model)")
    e.set_defaults(func=_cmd_export)
