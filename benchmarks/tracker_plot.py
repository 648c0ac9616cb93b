"""docs/images/tracker-plot.png: held-out bits/byte and training loss against tokens, read back from MLflow.

    python benchmarks/tracker_plot.py                          # train a short default run with MLflow on, then plot
    python benchmarks/tracker_plot.py --run-dir runs/tracked   # plot a run that logged to RUN_DIR/mlflow.db

Without --run-dir (or with one that holds no mlflow.db) it runs `diloco train` on the default config (4 islands,
the slow pool's speed EMULATED) with `--tracker mlflow --tracker tensorboard`, a budget of --tokens and an evaluation
every --eval-s seconds: about 2 minutes on 2 cores. The plot is made from what the MLflow tracker logged (the
run's SQLite store, `sqlite:///RUN_DIR/mlflow.db`), not from summary.json: it shows what a user of the tracker sees.
Needs the trackers extra and matplotlib.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, tokens: int, eval_s: float) -> None:
    """`diloco train` of the default config with the MLflow and TensorBoard trackers on."""
    cmd = [sys.executable, "-m", "orchestrator.cli", "train", "--run-dir", str(run_dir), "--quiet",
           "--set", f"run.token_budget={tokens}", "--set", f"eval.interval_s={eval_s}",
           "--tracker", "mlflow", "--tracker", "tensorboard"]
    print("running:", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, cwd=ROOT)


def read_back(run_dir: Path) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    """(the MLflow run's name, metric -> [(tokens, value)]) of the newest run in RUN_DIR/mlflow.db."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("diloco")
    (run,) = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    series = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
              for key in ("eval_bits_per_byte", "train_loss", "goodput")}
    return run.info.run_name, series


def plot(name: str, series: dict[str, list[tuple[int, float]]], out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    evals = series["eval_bits_per_byte"]
    ax.plot([t / 1e6 for t, _ in evals], [v for _, v in evals], "o-", label="held-out bits/byte (eval_bits_per_byte)")
    train_loss = series["train_loss"]  # nats per byte: the islands' latest losses, averaged, at each flush
    ax.plot([t / 1e6 for t, _ in train_loss], [v / math.log(2) for _, v in train_loss], "s--", alpha=0.8,
            label="training loss, bits/byte (train_loss / ln 2)")
    ax.set_xlabel("tokens processed (millions): the trackers' step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"Read back from MLflow: run {name}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="a run that logged to MLflow (default: train one under runs/)")
    p.add_argument("--tokens", type=int, default=1_500_000, help="token budget of the run trained here")
    p.add_argument("--eval-s", type=float, default=5.0, help="eval.interval_s of the run trained here")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "tracker-plot.png")
    args = p.parse_args(argv)
    run_dir = args.run_dir or ROOT / "runs" / f"tracked-{time.strftime('%Y%m%d-%H%M%S')}"
    if not (run_dir / "mlflow.db").is_file():
        train(run_dir, args.tokens, args.eval_s)
    import yaml

    name, series = read_back(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    goodput = series["goodput"][-1][1] if series["goodput"] else float("nan")
    note = (f"diloco train, default config (4 islands, the slow pool's speed EMULATED), token_budget "
            f"{cfg['run']['token_budget']:,}, eval every {cfg['eval']['interval_s']:g} s; goodput {goodput:.2f}")
    plot(name, series, args.out, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
