"""Does an honest island's outer gradient point along its fragment's outer momentum? What the poison guard's direction
rule leans on, measured in process (no Ray, nothing emulated).

--islands real LearnerIslands of the nano model train on the Python standard library's source bytes and submit
to a real OuterOptimizer core (the config's defaults, quorum 1, no grace) in turn; each adopts every published
version (rebase). Each cut's cosine with the fragment's outer momentum (what the guard reads) and with the other
islands' latest cut is kept. Every --every cuts per island, a fresh incarnation starts from the global parameters
(as a restart does) and its first cut is read the same way, three ways: as restarted (fresh AdamW, lr warm-up), with
no warm-up, and with no warm-up and island 1's AdamW state. Nothing of it is merged.

    python benchmarks/guard_drift.py --cuts 120 --every 40

Prints one row per checkpoint: the median of each fragment's last 8 established cosines, and the fresh cuts'.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import sysconfig
from dataclasses import replace

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from islands.island import LearnerIsland  # noqa: E402
from islands.messages import FragmentUpdate, Submission  # noqa: E402
from islands.model import build_model, model_config  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.core.outer_optimizer import OuterOptimizer  # noqa: E402
from orchestrator.core.round_merge import decoded  # noqa: E402
from orchestrator.settings import inner_settings, island_specs, model_recipe, outer_settings  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402
from policies.poison_guard import reading_of  # noqa: E402


def corpus(max_bytes: int) -> np.ndarray:
    """The standard library's .py files as bytes, in name order, up to `max_bytes`."""
    out, n = [], 0
    for f in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out.append(f.read_bytes())
        n += len(out[-1])
        if n >= max_bytes:
            break
    return np.frombuffer(b"".join(out)[:max_bytes], dtype=np.uint8).copy()


def flat(sub: Submission) -> torch.Tensor:
    return torch.cat([decoded(c).reshape(-1) for c in sub.payload])


class World:
    """The outer optimizer core, its islands and what was read of their cuts."""

    def __init__(self, args) -> None:
        self.cfg = build_config({"model": {"preset": "nano"}, "outer": {"min_quorum": 1, "grace_gamma": 0.0,
                                                                         "grace_cap_s": 0.0}})
        self.shape = model_config("nano")
        model = build_model(self.shape, seed=1)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
        self.outer = OuterOptimizer(init, self.plan, settings=outer_settings(self.cfg),
                                    embedding_names=model.embedding_parameter_names())
        self.inner = replace(inner_settings(self.cfg), batch_size=args.batch)
        self.data = corpus(args.bytes)
        self.n = args.islands
        self.islands = [self.make(i, 1, self.inner) for i in range(self.n)]
        for i in range(self.n):
            self.outer.register(i, 1)
        self.recent: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (island, delta) of the latest cut
        self.cos: dict[int, list[tuple[float, float]]] = {0: [], 1: []}

    def latest(self) -> list[FragmentUpdate]:
        return [FragmentUpdate(p, self.outer.versions[p], [self.outer.fragment(p)]) for p in range(2)]

    def make(self, island: int, incarnation: int, inner) -> LearnerIsland:
        recipe = model_recipe(self.cfg, shape=self.shape)
        spec = replace(island_specs(self.cfg, recipe, self.plan)[0], island=island, incarnation=incarnation,
                       pool="p", num_islands=self.n, inner=inner, seed=1 + island + 100 * incarnation,
                       adoption="rebase")
        return LearnerIsland(spec, self.data, self.latest())

    def with_momentum(self, sub: Submission) -> float:
        """The cosine the guard reads (policies.poison_guard.reading_of); nan before the fragment has momentum."""
        deltas = [decoded(c) for c in sub.payload]
        r = reading_of(sub.island, deltas, [None] * len(deltas), sub.inner_steps,
                       self.outer._opts[sub.fragment].momentum_buffers())
        return math.nan if r.alignment is None else r.alignment

    def with_last_other(self, sub: Submission) -> float:
        last = self.recent.get(sub.fragment)
        if last is None or last[0] == sub.island:
            return math.nan
        return float(torch.nn.functional.cosine_similarity(flat(sub), last[1], dim=0))

    def round(self, now: float) -> None:
        for isl in self.islands:
            sub = first_cut(isl)
            self.cos[sub.fragment].append((self.with_momentum(sub), self.with_last_other(sub)))
            self.recent[sub.fragment] = (sub.island, flat(sub))
            results, _ = self.outer.receive(sub, now=now)
            for r in results:
                for o in self.islands:
                    o.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
            for o in self.islands:
                o.apply_updates()


def first_cut(isl: LearnerIsland) -> Submission:
    while True:
        isl.step()
        sub = isl.next_submission(0.0)
        if sub is not None:
            return sub


def median_of(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--islands", type=int, default=4)
    ap.add_argument("--cuts", type=int, default=120, help="cuts per island (default 120)")
    ap.add_argument("--every", type=int, default=40, help="a fresh incarnation's first cut every this many cuts")
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step (default 8)")
    ap.add_argument("--bytes", type=int, default=4_000_000, help="corpus bytes (default 4 MB)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w = World(args)
    no_warmup = replace(w.inner, warmup_steps=0)
    print("In process, no Ray, nothing emulated: nano islands, the config's outer defaults at quorum 1, rebase adoption.")
    print("| cuts per island | versions | fragment 0: momentum / last other | fragment 1: momentum / last other "
          "| fresh | fresh, no warm-up | fresh, no warm-up, island 1's AdamW |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for cut in range(1, args.cuts + 1):
        w.round(float(cut))
        if cut % args.every:
            continue
        fresh = []
        for inner, state in ((w.inner, False), (no_warmup, False), (no_warmup, True)):
            f = w.make(0, 1000 + cut, inner)
            if state:
                f.trainer.optimizer.load_state_dict(w.islands[1].trainer.optimizer.state_dict())
            sub = first_cut(f)
            fresh.append(f"{w.with_momentum(sub):+.3f} (fragment {sub.fragment}, {sub.inner_steps} steps)")
        cells = [f"{median_of(m for m, _ in w.cos[p][-8:]):+.3f} / {median_of(o for _, o in w.cos[p][-8:]):+.3f}"
                 for p in (0, 1)]
        print(f"| {cut} | {w.outer.versions} | {cells[0]} | {cells[1]} | " + " | ".join(fresh) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
