"""torchft side by side: the peer a user would pick, on our model, data and EMULATED wan-4-regions network.

Three systems, each in its own run directory, on one config (benchmarks/compare.py's wan-4-regions
scenario: four one-island pools us-east, us-central, us-west, us-south; the tiny model; every run on one
inner lr schedule; the same token budget, H and held-out batches):

  decoupled   our engine, compare.py's decoupled settings (K = 1, grace, RDA, int4 up, int8/int4 down, P = 2)
  sync-diloco our engine in mode sync-diloco (K = all, mean, P = 1, islands wait for each round)
  torchft     torchft's own DiLoCo (torchft 0.2.0 from PyPI: its Manager, lighthouse, ProcessGroupGloo and
              local_sgd.DiLoCo, P = 1, outer Nesterov SGD lr 0.7 momentum 0.9 as ours), one replica group per
              island slot, each its own process (benchmarks/torchft_run.py, benchmarks/torchft_replica.py);
              the EMULATED ring all-reduce time of its float32 pseudo-gradient is slept at its all-reduce

Scenarios, each measured in one invocation, every repeat running all three systems:

  clean   no failures: held-out loss at equal tokens (the fewest any of the three processed, interpolated between
          evaluations; final losses are on each run's own token count); wall time to the target loss
  faults  chaos.py's fault tape: each island / replica group killed --failures times at the same seconds
          (benchmarks/chaos.py's fixed_tape over 10 s to 85% of this repeat's clean decoupled wall time, so
          every kill fires in every run); killed islands and replica groups restart as fresh processes (no warm
          spares for either); time to the target, tokens merged per second kept against the system's own clean
          run, tokens lost
  slow    pool us-west EMULATED 1.6x slower: time to the target

Target loss in each scenario and repeat: the worst final held-out loss of its three runs, so each reaches it
(compare.py's rule); time to it is when the held-out loss reaches it for good. Ratios are torchft's (and
sync-diloco's) time over decoupled's, per repeat, then medians. Run benchmarks/torchft_equivalence.py first:
it checks that torchft's DiLoCo and our sync-diloco mode compute the same losses on the same inputs.

  python benchmarks/torchft_side_by_side.py --quick                       # 1 repeat, 250k tokens, H = 10, 1 kill each
  python benchmarks/torchft_side_by_side.py --repeats 2 --out runs/tft     # 2 repeats at the default 500k tokens
  python benchmarks/torchft_side_by_side.py --scenarios clean,slow         # a subset
  python benchmarks/torchft_side_by_side.py --systems decoupled --scenarios clean,faults --set-all inner.warmup_steps=5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import compare  # noqa: E402 - sets up sys.path, PYTHONPATH and RAY_AUTH_MODE for the project's imports
import ray  # noqa: E402
from torchft_run import train_torchft  # noqa: E402

from policies.chaos import FaultTape, fixed_tape  # noqa: E402

SYSTEMS = ("decoupled", "sync-diloco", "torchft")
SCENARIOS = ("clean", "faults", "slow")
SLOW_POOL, SLOW_FACTOR = "us-west", 1.6
TARGETS = {"faults": 3.0, "slow": 1.5, "loss_gap": 0.02}  # the issue's expectations, checked and printed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 250k tokens, H = 10, 1 kill per island")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    ap.add_argument("--budget", type=int, default=None, help="tokens per run (default 500k; --quick 250k)")
    ap.add_argument("--sync-every", type=int, default=None, help="H of every system (default 20; --quick 10)")
    ap.add_argument("--failures", type=int, default=None, help="kills per island on the tape (default 2; --quick 1)")
    ap.add_argument("--local-step-s", type=float, default=None, help="inner-step time the network is scaled to (default: measured once)")
    ap.add_argument("--final-eval-batches", type=int, default=64, help="held-out batches each final model is scored on (default 64)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset of decoupled, sync-diloco, torchft (ratios are over decoupled: leave it out "
                         "only to complete an earlier invocation's repeat, then --analyse its directory)")
    ap.add_argument("--tape", type=Path, default=None,
                    help="the faults scenario's tape (a chaos tape YAML, e.g. an earlier invocation's r1/faults/tape.yaml) "
                         "instead of one over 85%% of this repeat's clean decoupled run")
    ap.add_argument("--analyse", type=Path, nargs="+", default=None, metavar="RUNS_JSON_OR_OUT_DIR",
                    help="run nothing: analyse earlier invocations together (their repeats pooled), each a runs.json or an "
                         "--out directory whose repeat was cut short (its finished runs' summary.json files, engine runs rescored)")
    ap.add_argument("--set-all", dest="all_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every system's runs, e.g. inner.warmup_steps=5 (torchft's replicas read "
                         "the same inner settings); as compare.py's --set-all")
    ap.add_argument("--seed", type=int, default=0, help="run and tape seed")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default runs/torchft-<timestamp>)")
    args = ap.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad or not args.scenarios:
        ap.error(f"--scenarios {bad or '(none)'}: pick from {', '.join(SCENARIOS)}")
    args.systems = [n for n in SYSTEMS if n in args.systems.split(",")]
    for item in args.all_overrides:  # checked here, in one line, before any run (compare.py's rule)
        key = item.split("=", 1)[0].strip()
        if key.split(".", 1)[0] in ("pools", "network", "health", "chaos") or key in ("run.token_budget", "mode"):
            ap.error(f"--set-all {item}: pools, network, health, chaos, mode and the budget are the scenarios'")
    try:
        compare.load_config(overrides=args.all_overrides)
    except compare.ConfigError as err:
        ap.error(str(err))
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: pass 1 or more")
    args.repeats = 1 if args.quick else args.repeats
    args.budget = args.budget or (250_000 if args.quick else 500_000)
    args.sync_every = args.sync_every or (10 if args.quick else 20)
    args.failures = args.failures or (1 if args.quick else 2)
    args.out = compare.fresh_out_dir(ap, args.out, "torchft")
    return args


def compare_args(args: argparse.Namespace) -> argparse.Namespace:
    """compare.py's own arguments for the same scenario, so decoupled and sync-diloco are configured as there."""
    extra = [a for item in args.all_overrides for a in ("--set-all", item)]
    cargs = compare.build_parser().parse_args(["--budget", str(args.budget), "--seed", str(args.seed),
                                              "--final-eval-batches", str(args.final_eval_batches), *extra])
    compare.fill_defaults(cargs)
    cargs.sync_every_steps, cargs.eval_interval_s, cargs.eval_batches = args.sync_every, 5.0, 8
    cargs.local_step_s = args.local_step_s
    return cargs


def configs(cargs: argparse.Namespace, scenario: str, tape_path: Path | None) -> dict[str, dict]:
    """The three systems' config dicts for one scenario (torchft reads the same config: pools, network, H, outer lr)."""
    base = compare.base_config(cargs)
    base["health"] = {"warm_spares": 0}
    if scenario == "slow":
        base["pools"] = [{**p, "emulated_slowdown": SLOW_FACTOR} if p["region"] == SLOW_POOL else p for p in base["pools"]]
    ours = {n: extra for n, _, extra in compare.methods(cargs) if n in ("decoupled", "sync-diloco")}
    out = {n: compare.deep_merge(base, ours[n]) for n in ("decoupled", "sync-diloco")}
    out["torchft"] = compare.deep_merge(base, {"outer": {"num_fragments": 1}})
    if tape_path is not None:
        for n in ("decoupled", "sync-diloco"):
            out[n] = compare.deep_merge(out[n], {"chaos": {"mode": "tape", "params": {"path": str(tape_path)}}})
    return out


def run_system(name: str, data: dict, run_dir: Path, args: argparse.Namespace, tape: list[tuple[float, int]]) -> dict:
    """One system's run; its summary with `final_loss_wide` (the final model on --final-eval-batches batches)."""
    if name != "torchft":
        return compare.run_one(name, "engine", data, run_dir, args.final_eval_batches, 60.0)
    t0 = time.monotonic()
    s = train_torchft(compare.build_config(data), run_dir, tape=tape, final_eval_batches=args.final_eval_batches)
    print(f"  torchft: {time.monotonic() - t0:.0f}s total, loss {s['eval_loss']:.4f} after {s['tokens_processed']:,} tokens, "
          f"wall {s['wall_s']:.0f}s, {s['commits']} commits, {s['faults_injected']} kills", file=sys.stderr, flush=True)
    return s


def run_repeat(args: argparse.Namespace, cargs: argparse.Namespace, r: int) -> dict[str, dict[str, dict]]:
    """Every scenario of one repeat: {scenario: {system: summary}}."""
    rep: dict[str, dict[str, dict]] = {}
    for scenario in args.scenarios:
        where = args.out / f"r{r}" / scenario
        where.mkdir(parents=True, exist_ok=True)
        tape: list[tuple[float, int]] = []
        tape_path = None
        if scenario == "faults":
            clean = rep.get("clean", {}).get("decoupled")
            horizon = 0.85 * clean["wall_s"] if clean else 60.0
            ft = FaultTape.from_yaml(args.tape) if args.tape else fixed_tape(
                islands=len(compare.REGIONS), failures_per_island=args.failures, horizon_s=horizon, start_s=10.0, seed=args.seed)
            tape_path = where / "tape.yaml"
            ft.to_yaml(tape_path)
            tape = [(f.at_s, f.island) for f in ft.faults]
            print(f"repeat {r} faults: {len(tape)} kills at {', '.join(f'{t:.0f}s (#{i})' for t, i in tape)}", file=sys.stderr)
        print(f"repeat {r}, scenario {scenario}", file=sys.stderr, flush=True)
        rep[scenario] = {n: run_system(n, data, where / n, args, tape) for n, data in configs(cargs, scenario, tape_path).items()
                         if n in args.systems}
    return rep


# ---------------------------------------------------------------------------- analysis


def loss_at_tokens(evals: list[dict], tokens: float) -> float | None:
    """Held-out loss when the run had processed `tokens`, interpolated between its evaluations (None if it never did)."""
    pts = sorted((e["tokens_processed"], e["eval_loss"]) for e in evals)
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (tokens - t0) / (t1 - t0) * (l1 - l0)
    return None


def analyse(runs: list[dict[str, dict[str, dict]]]) -> dict:
    """Per scenario and repeat: target, times to it, ratios over decoupled, losses, kept throughput; then medians."""
    out: dict[str, Any] = {}
    for scenario in dict.fromkeys(sc for rep in runs for sc in rep):  # every scenario any repeat ran, in run order
        rows = []
        for rep in (r for r in runs if scenario in r):
            s = rep[scenario]
            target = max(x["eval_loss"] for x in s.values())  # compare.py's rule: the worst final loss (own evaluations)
            equal = min(x["tokens_processed"] for x in s.values())
            row: dict[str, Any] = {"target_loss": target, "equal_tokens": equal, "systems": {}}
            for n, x in s.items():
                t, toks = compare.time_to_target(x["evals"], target)
                merged = x.get("tokens_merged") or 0
                m = {"time_to_target_s": t, "final_loss": compare.final_loss(x), "final_loss_own_eval": x["eval_loss"],
                     "loss_at_equal_tokens": loss_at_tokens(x["evals"], equal),
                     "tokens_processed": x["tokens_processed"], "tokens_merged": merged,
                     "tokens_lost": x["tokens_processed"] - merged, "wall_s": x["wall_s"],
                     "merged_per_s": merged / x["wall_s"] if x["wall_s"] else None, "faults": x.get("faults_injected", 0)}
                clean = rep.get("clean", {}).get(n)
                if scenario != "clean" and clean:
                    base = (clean.get("tokens_merged") or 0) / clean["wall_s"]
                    m["kept_vs_clean"] = m["merged_per_s"] / base if base else None
                    m["loss_vs_clean"] = m["final_loss"] / compare.final_loss(clean) - 1
                row["systems"][n] = m
            dec = row["systems"]["decoupled"]
            for n in ("torchft", "sync-diloco"):
                t = row["systems"].get(n, {}).get("time_to_target_s")
                row[f"{n}_over_decoupled"] = t / dec["time_to_target_s"] if t and dec["time_to_target_s"] else None
            tft = row["systems"].get("torchft")
            row["decoupled_loss_vs_torchft"] = dec["final_loss"] / tft["final_loss"] - 1 if tft else None
            rows.append(row)
        keys = ("time_to_target_s", "final_loss", "loss_at_equal_tokens", "tokens_processed", "tokens_merged", "tokens_lost", "wall_s", "merged_per_s",
                "kept_vs_clean", "loss_vs_clean", "faults")
        med = {n: {k: compare.median([r["systems"][n].get(k) for r in rows if n in r["systems"]]) for k in keys}
               for n in SYSTEMS if any(n in r["systems"] for r in rows)}
        out[scenario] = {"per_repeat": rows, "median": med, "target_loss": compare.median([r["target_loss"] for r in rows]),
                         **{f"{n}_over_decoupled": compare.median([r[f"{n}_over_decoupled"] for r in rows])
                            for n in ("torchft", "sync-diloco")},
                         "decoupled_loss_vs_torchft": compare.median([r["decoupled_loss_vs_torchft"] for r in rows])}
    return out


def fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def times(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.2f}%"


def table(res: dict, notes: list[str]) -> str:
    """Markdown: per scenario one row per system (medians), the per-repeat ratios, the issue's checks, the notes."""
    lines = []
    for scenario, s in res.items():
        per = "; ".join(f"r{i + 1}: torchft {times(r['torchft_over_decoupled'])}, sync-diloco "
                        f"{times(r['sync-diloco_over_decoupled'])}" for i, r in enumerate(s["per_repeat"]))
        lines += [f"**{scenario}** (target held-out loss {s['target_loss']:.4f}; time to it over decoupled's: torchft "
                  f"{times(s['torchft_over_decoupled'])}, sync-diloco {times(s['sync-diloco_over_decoupled'])}; {per})", "",
                  "| system | final held-out loss | loss at equal tokens | time to target s | tokens processed | tokens merged | "
                  "tokens lost | merged tokens/s | kept vs own clean | loss vs own clean | kills | wall s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n, m in s["median"].items():
            lines.append(f"| {n} | {m['final_loss']:.4f} | {fmt(m['loss_at_equal_tokens'], '.4f')} | "
                         f"{fmt(m['time_to_target_s'], '.1f')} | {m['tokens_processed']:,.0f} | "
                         f"{m['tokens_merged']:,.0f} | {m['tokens_lost']:,.0f} | {fmt(m['merged_per_s'], ',.0f')} | "
                         f"{fmt(m['kept_vs_clean'], '.3f')} | "
                         f"{pct(m['loss_vs_clean'])} | "
                         f"{m['faults']:.0f} | {m['wall_s']:.0f} |")
        lines.append("")
    checks = []
    for scenario in ("faults", "slow"):
        if scenario in res:
            r = res[scenario]["torchft_over_decoupled"]
            gap = res[scenario]["decoupled_loss_vs_torchft"]
            ok = r is not None and gap is not None and r >= TARGETS[scenario] and gap <= TARGETS["loss_gap"]
            checks.append(f"- {'PASS' if ok else 'MISS'}: {scenario}: decoupled reaches the target >= {TARGETS[scenario]:g}x sooner "
                          f"than torchft at a final loss within 2% of it: measured {times(r)}, final loss {pct(gap)} vs torchft")
    return "\n".join(lines + checks + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    compare.log_runs_and_warn_on_console(args.out)
    if args.analyse:
        runs = [rep for path in args.analyse for rep in load_runs(path, args.final_eval_batches)]
        args.repeats, args.scenarios = len(runs), list(dict.fromkeys(sc for rep in runs for sc in rep))
        return report(args, runs, "analysed from " + ", ".join(map(str, args.analyse)))
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    cargs = compare_args(args)
    if args.local_step_s is None:  # before Ray starts, as compare.py
        args.local_step_s = cargs.local_step_s = compare.measure_local_step(cargs)
    engine = any(n != "torchft" for n in args.systems)  # torchft alone needs no Ray
    if engine:
        compare.start_local_ray()
    runs = []
    try:
        print(f"budget {args.budget:,} tokens, H {args.sync_every}, EMULATED wan-4-regions scaled to {args.local_step_s:.4f} s/step, "
              f"{args.repeats} repeat(s), scenarios {', '.join(args.scenarios)}, out {args.out}", file=sys.stderr)
        for r in range(1, args.repeats + 1):
            runs.append(run_repeat(args, cargs, r))
            (args.out / "runs.json").write_text(json.dumps(runs, indent=2, default=str))
    finally:
        if engine:
            ray.shutdown()
    if "decoupled" not in args.systems:
        print(f"no decoupled run: copy this repeat's other runs into {args.out}/r1/ and --analyse it", file=sys.stderr)
        return 0
    return report(args, runs, f"started {started} UTC")


def load_runs(path: Path, final_eval_batches: int) -> list[dict[str, dict[str, dict]]]:
    """An invocation's repeats: its runs.json, or from an --out directory OUT/r<k>/<scenario>/<system>/summary.json
    (engine runs' final models scored again on `final_eval_batches` batches, as compare.run_one does)."""
    if path.is_file():
        return json.loads(path.read_text())
    runs = []
    for rdir in sorted(path.glob("r[0-9]*")):
        rep: dict[str, dict[str, dict]] = {}
        for scenario in SCENARIOS:
            done = {n: rdir / scenario / n for n in SYSTEMS if (rdir / scenario / n / "summary.json").is_file()}
            if "decoupled" not in done:
                continue
            rep[scenario] = {}
            for n, run_dir in done.items():
                summary = json.loads((run_dir / "summary.json").read_text())
                if n != "torchft" and final_eval_batches:
                    summary.update(compare.score_final(run_dir, final_eval_batches))
                rep[scenario][n] = summary
        if rep:
            runs.append(rep)
    return runs


def report(args: argparse.Namespace, runs: list[dict[str, dict[str, dict]]], started: str) -> int:
    """table.md and results.json in --out, the table printed."""
    res = analyse(runs)
    every = [x for rep in runs for sc in rep.values() for x in sc.values()]
    notes = sorted({x["network"] for x in every}) + sorted({x["emulation"] for x in every if x.get("emulation")})
    tft = [x for x in every if x.get("mode") == "torchft-diloco"]
    if tft:
        delays = ", ".join(sorted({f"{x['allreduce_emulated_s']:.1f}" for x in tft}))
        notes.append(f"torchft {tft[0]['torchft']} (PyPI), its DiLoCo with P = 1 and use_bucketization: one all-reduce of the "
                     f"float32 pseudo-gradient per sync, EMULATED {delays} s among 4 regions; lighthouse min_replicas 1 with the "
                     "torchft_lighthouse command's timeouts, Manager min_replica_size 1, gloo; replica groups and islands "
                     "restart as fresh processes (no warm spares)")
    budget = next((x["token_budget"] for x in every if "token_budget" in x), args.budget)
    notes.append(f"{len(runs)} repeat(s), medians; token budget {budget:,} per run"
                 + ("" if args.analyse else f"; H {args.sync_every}; {args.failures} kill(s) per island on the tape")
                 + f"; model tiny; final losses on {args.final_eval_batches} held-out batches; {started}")
    text = table(res, notes)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "analysis": res,
                                                       "runs": runs}, indent=2, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
