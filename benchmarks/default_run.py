"""The default run against itself changed: a variant's overrides, or another code tree, three repeats alternated.

Each repeat runs every arm once, in an order that rotates between repeats so that no arm always runs first (a
cold page cache) or last (a warmer machine). An arm is `diloco train` at the defaults (configs/default.yaml: four
islands in two pools, the slow pool EMULATED x1.6), in a subprocess, in its own run dir, with:

  --variant NAME:KEY=VALUE[,KEY=VALUE...]   those `--set` overrides (repeatable); run from the tree's root, so an
                                            import path such as examples.extending.pier_warmup:make resolves
  --tree NAME=PATH                          another checkout's code (PYTHONPATH and working directory PATH):
                                            the same run before and after a change, same machine, same load

and the defaults themselves as arm `default` (this tree). Every final model is then scored by this tree on
--final-eval-batches held-out batches (benchmarks/compare.py `score_final`; why 256 batches: its docstring).

Printed: per arm the final held-out loss of each repeat, its median and its change against `default`'s median,
the run's own held-out bits/byte, goodput and uptime, and training wall seconds. The emulated slow pool is
emulation, and the table says so.

  python benchmarks/default_run.py --repeats 3 --variant pier:outer.optimizer=examples.extending.pier_warmup:make
  python benchmarks/default_run.py --repeats 3 --tree before=/tmp/wt-before --json /tmp/before_after.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from benchmarks.compare import score_final  # noqa: E402


def parse_arms(variants: list[str], trees: list[str]) -> list[dict]:
    """The arms: `default`, then each --variant (NAME:KEY=VALUE,...) and --tree (NAME=PATH), in order given.

    Raises ValueError naming the bad argument and its expected shape."""
    arms = [{"name": "default", "tree": _ROOT, "sets": []}]
    for v in variants:
        name, sep, sets = v.partition(":")
        if not sep or not name or not sets or any("=" not in s for s in sets.split(",")):
            raise ValueError(f"--variant {v!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        arms.append({"name": name, "tree": _ROOT, "sets": sets.split(",")})
    for t in trees:
        name, sep, path = t.partition("=")
        if not sep or not name or not (Path(path) / "orchestrator").is_dir():
            raise ValueError(f"--tree {t!r}: expected NAME=PATH, PATH a checkout holding orchestrator/")
        arms.append({"name": name, "tree": os.path.abspath(path), "sets": []})
    names = [a["name"] for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names repeat: {names}; give each --variant and --tree its own NAME")
    return arms


def order(arms: list[dict], repeat: int) -> list[dict]:
    """Repeat `repeat`'s running order: the arms rotated by `repeat`."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def run_arm(arm: dict, run_dir: Path) -> dict:
    """One `diloco train` of `arm` into `run_dir`; its summary.json. Raises RuntimeError with the log's tail."""
    env = {**os.environ, "PYTHONPATH": arm["tree"], "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray per run, as a user's first `diloco train`
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "train", "--run-dir", str(run_dir), "--quiet"]
    for s in arm["sets"]:
        cmd += ["--set", s]
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=arm["tree"], env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "".join(open(log).readlines()[-15:])
        raise RuntimeError(f"arm {arm['name']}: diloco train exited {code} (log {log}):\n{tail}")
    return json.loads((run_dir / "summary.json").read_text())


def table(arms: list[dict], results: dict[str, list[dict]]) -> str:
    """The markdown table of every arm's repeats and medians, the change against `default`'s median loss."""
    base = statistics.median(r["final_loss_wide"] for r in results["default"])
    rows = ["| arm | final held-out loss (repeats) | median | vs default | run's bits/byte | goodput, uptime | "
            "training wall s |", "| --- | --- | ---: | ---: | --- | --- | --- |"]
    for arm in arms:
        rs = results[arm["name"]]
        losses = [r["final_loss_wide"] for r in rs]
        med = statistics.median(losses)
        what = arm["name"] if not arm["sets"] else f"{arm['name']} (`{','.join(arm['sets'])}`)"
        cells = [", ".join(f"{x:.4f}" for x in losses), f"{med:.4f}", f"{100 * (med / base - 1):+.2f}%",
                 ", ".join(f"{r['eval_bits_per_byte']:.4f}" for r in rs),
                 ", ".join(f"{r['goodput']:.3f}/{r['uptime']:.3f}" for r in rs),
                 ", ".join(f"{r['wall_s']:.1f}" for r in rs)]
        rows.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every arm (default 3)")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE[,KEY=VALUE...] (repeatable)")
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of another checkout (repeatable)")
    ap.add_argument("--final-eval-batches", type=int, default=256, help="held-out batches scoring each final model")
    ap.add_argument("--out", type=Path, default=Path("runs/default-run"), help="where the run dirs go")
    ap.add_argument("--json", type=Path, default=None, help="also write every summary and the table here")
    args = ap.parse_args(argv)
    try:
        arms = parse_arms(args.variant, args.tree)
    except ValueError as err:
        ap.error(str(err))
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: give at least 1")
    results: dict[str, list[dict]] = {a["name"]: [] for a in arms}
    started = time.monotonic()
    total = args.repeats * len(arms)
    for repeat in range(args.repeats):
        for arm in order(arms, repeat):
            run_dir = args.out / f"{arm['name']}-r{repeat}"
            if run_dir.exists():
                sys.exit(f"{run_dir} exists: pass another --out or remove it")
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            summary = run_arm(arm, run_dir)
            summary.update(score_final(run_dir, args.final_eval_batches))
            results[arm["name"]].append(summary)
            done = sum(len(v) for v in results.values())
            print(f"[{done}/{total}] {arm['name']} repeat {repeat + 1}: loss {summary['final_loss_wide']:.4f} "
                  f"({summary['final_eval_tokens']:,} held-out tokens), goodput {summary['goodput']:.3f}, "
                  f"{time.monotonic() - t0:.0f}s; {time.monotonic() - started:.0f}s so far", file=sys.stderr, flush=True)
    note = results["default"][0].get("emulation") or "slow pool's speed EMULATED"
    text = table(arms, results)
    print(f"\nThe default run (emulation: {note}), {args.repeats} repeats per arm, alternated:\n\n{text}")
    if args.json:
        args.json.write_text(json.dumps({"arms": arms, "results": results, "table": text}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
