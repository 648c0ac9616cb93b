"""The outer optimizer's checkpoint: what `OuterOptimizer.state_dict` writes and `load_state_dict` restores.

Tensors: the global parameters (``PARAM_PREFIX``), each fragment's outer optimizer state
(core/fragment_optimizers.py), the served moving average (core/served_average.py) and RDA's window across
rounds (``rda_window/{name}``). JSON metadata: versions, the token ledger, data cursors, the window's norms
and the poison guard's history. Pending submissions are not saved: after a restore they were never received.
The merge rule and compression are not in it: the run's config names them (a name or an import path), so a
resumed run loads the same plug-ins again.
"""

from __future__ import annotations

from typing import Any

import torch

from islands.cursor import DataCursor
from orchestrator.core.checkpoint import PARAM_PREFIX
from orchestrator.core.fragment_optimizers import load_optimizer, save_optimizer

# `core` below is an orchestrator.core.outer_optimizer.OuterOptimizer, typed Any: that module imports this one,
# and an import back, even for typing, would be a circle (tests/test_layout.py).
OuterOptimizer = Any

__all__ = ["checkpoint_of", "restore_checkpoint"]

RDA_WINDOW_PREFIX = "rda_window/"


def checkpoint_of(core: OuterOptimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON metadata) of `core` for a checkpoint (module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    windows = [None if w is None else w.state_dict() for w in core._rda_windows]
    states = []
    for p, (names, frag) in enumerate(zip(core.plan.fragments, core.params)):
        for name, t in zip(names, frag):
            tensors[PARAM_PREFIX + name] = t.clone()
        states.append(save_optimizer(core._opts[p], p, names, tensors))
        if core.average is not None:
            core.average.save(p, names, tensors)
        window = windows[p]
        if window is not None:
            for name, v in zip(names, window["sums"]):
                if v is not None:
                    tensors[RDA_WINDOW_PREFIX + name] = v
    meta = {
        "versions": list(core.versions), "tokens_merged": list(core.tokens_merged),
        "tokens_refused": list(core.tokens_refused), "bytes_received": core.bytes_received,
        # Pending submissions are not saved: after a restore they were never received (and so lost).
        "received": [[i, inc, toks] for (i, inc), toks in _received_without_pending(core).items()],
        "useful_s": core.useful_s, "resume_cursor": {str(k): list(v) for k, v in core.resume_cursor.items()},
        "rounds": len(core.rounds), "fragments": [list(f) for f in core.plan.fragments],
        "rda_window_norms": [None if w is None else w["norms"] for w in windows],
        "poison_guard": None if core.guard is None else core.guard.state_dict(),
    }
    if any(m is not None for m in states):  # a plug-in's (the built-in's checkpoint is as it was)
        meta["outer_state"] = states
    return tensors, meta


def _received_without_pending(core: OuterOptimizer) -> dict[tuple[int, int], list[int]]:
    out = {k: list(v) for k, v in core.received.items()}
    for r in core._open:
        for e in r.pending:
            out[(e.sub.island, e.sub.incarnation)][e.sub.fragment] -= e.sub.tokens
    return out


def restore_checkpoint(core: OuterOptimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore into `core` what :func:`checkpoint_of` wrote; refuses a checkpoint of another model or fragment plan."""
    if [list(f) for f in core.plan.fragments] != meta.get("fragments"):
        raise ValueError("checkpoint was written for another model or fragment plan; start a new run directory")
    fragments = len(core.plan.fragments)
    for p, names in enumerate(core.plan.fragments):
        with torch.no_grad():
            for t, name in zip(core.params[p], names):
                t.copy_(tensors[PARAM_PREFIX + name])
        state = (meta.get("outer_state") or [None] * fragments)[p]  # None: the built-in's
        load_optimizer(core._opts[p], p, names, tensors, state)
        norms = (meta.get("rda_window_norms") or [None] * fragments)[p]
        window = core._rda_windows[p]
        if window is not None and norms is not None:  # else the window starts empty
            window.load_state_dict({"norms": norms, "sums": [tensors.get(RDA_WINDOW_PREFIX + n) for n in names]})
        if core.average is not None:  # a checkpoint written without averaging starts it at its global model
            core.average.load(p, names, tensors, core.params[p])
        core._open[p].clear()
    core.versions = list(meta["versions"])
    core.tokens_merged = list(meta["tokens_merged"])
    core.tokens_refused = list(meta["tokens_refused"])
    core.bytes_received = meta["bytes_received"]
    core.received = {(i, inc): list(toks) for i, inc, toks in meta["received"]}
    core.useful_s = meta["useful_s"]
    core.resume_cursor = {int(k): DataCursor.of(v) for k, v in meta["resume_cursor"].items()}
    if core.guard is not None and meta.get("poison_guard") is not None:  # else its windows fill again
        core.guard.load_state_dict(meta["poison_guard"])
