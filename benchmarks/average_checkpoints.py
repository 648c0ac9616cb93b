"""How much a moving average of a finished run's model would have given, from its checkpoints, post hoc.

Reads every checkpoint RUN_DIR still holds (train with a short `checkpoint.every_s` and a large
`checkpoint.keep` to have many: e.g. `--set checkpoint.every_s=5 --set checkpoint.keep=120`), and
scores on `--batches` held-out batches: the final model, the uniform average of the checkpoints in the
last fraction F of the tokens merged for each `--uniform F`, and the power-function moving average of
`run.average_window` (policies/averaging.py) replayed over the checkpoints for each `--window W`
(started at the oldest checkpoint held, so W should be well under the share of tokens they span).
Checkpoints are of the raw global model (`--raw` semantics), whatever the run served.

  python benchmarks/average_checkpoints.py runs/dense
  python benchmarks/average_checkpoints.py runs/dense --uniform 0.02,0.08 --window 0.04 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri  # noqa: E402
from orchestrator.run.trained import TrainedModel, TrainedModelError, evaluate_trained, load_trained  # noqa: E402
from policies.averaging import average_weight  # noqa: E402


def fractions(text: str) -> list[float]:
    """'0.01,0.04' -> [0.01, 0.04]; each must be in (0, 1]."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated fractions, e.g. 0.01,0.04") from None
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: every fraction must be in (0, 1]")
    return out


def load_checkpoints(run_dir: str | Path, trained: TrainedModel) -> list[tuple[int, float, dict[str, torch.Tensor]]]:
    """(step, tokens merged, raw global parameters) of every checkpoint `run_dir` holds, oldest first; `trained`
    is its model as load_trained read it (which validated the directory and its newest checkpoint)."""
    store = CheckpointStore(run_checkpoint_uri(trained.run_config.checkpoint.uri, run_dir))
    out = []
    for step in store.list():
        ckpt = store.load(step)
        merged = ckpt.meta.get("outer", {}).get("tokens_merged")
        if merged is None:
            raise TrainedModelError(f"checkpoint {step} of {run_dir} records no tokens merged: an engine run's "
                                    "checkpoints do; data-parallel runs keep only their final model")
        out.append((step, sum(merged) / len(merged), ckpt.parameters()))
    return out


def uniform_average(checkpoints, fraction: float) -> tuple[dict[str, torch.Tensor], int]:
    """Mean of the checkpoints in the last `fraction` of the tokens merged, and how many there were."""
    end = checkpoints[-1][1]
    chosen = [p for _, tokens, p in checkpoints if tokens >= end * (1 - fraction)]
    return {n: sum(p[n] for p in chosen) / len(chosen) for n in chosen[0]}, len(chosen)


def replayed_average(checkpoints, window: float) -> dict[str, torch.Tensor]:
    """run.average_window's rule replayed over the checkpoints, each standing for the rounds since the one before."""
    average = {n: t.clone() for n, t in checkpoints[0][2].items()}
    before = checkpoints[0][1]
    for _, tokens, params in checkpoints[1:]:
        w = average_weight(tokens - before, tokens, window)
        before = tokens
        for n, a in average.items():
            a.lerp_(params[n], w)
    return average


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--batches", type=int, default=256, help="held-out batches per score (default 256)")
    ap.add_argument("--uniform", type=fractions, default=[0.005, 0.01, 0.02, 0.04, 0.08, 0.16],
                    help="tail fractions of tokens to average uniformly (default 0.005,...,0.16)")
    ap.add_argument("--window", type=fractions, default=[0.01, 0.02, 0.04, 0.08],
                    help="run.average_window values to replay (default 0.01,0.02,0.04,0.08)")
    ap.add_argument("--json", default=None, help="also write the scores here")
    args = ap.parse_args(argv)
    try:
        model = load_trained(args.run_dir, raw=True)
        checkpoints = load_checkpoints(args.run_dir, model)
    except TrainedModelError as err:
        print(f"average_checkpoints: {err}", file=sys.stderr)
        return 2

    def score(params: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for n, p in model.model.named_parameters():
                p.copy_(params[n])
        return evaluate_trained(model, [f"eval.batches={args.batches}"])["eval_loss"]

    end = checkpoints[-1][1]
    print(f"{args.run_dir}: {len(checkpoints)} checkpoints over the last {1 - checkpoints[0][1] / end:.1%} of "
          f"{end:,.0f} tokens merged; losses on {args.batches} held-out batches")
    final = score(checkpoints[-1][2])
    rows = [("final model", final)]
    for f in args.uniform:
        params, n = uniform_average(checkpoints, f)
        rows.append((f"uniform, last {f:g} ({n} checkpoints)", score(params)))
    for w in args.window:
        rows.append((f"run.average_window={w:g}", score(replayed_average(checkpoints, w))))
    print("| model | held-out loss | vs final |\n| --- | ---: | ---: |")
    for name, loss in rows:
        print(f"| {name} | {loss:.4f} | {loss / final - 1:+.2%} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"model": n, "eval_loss": v} for n, v in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
