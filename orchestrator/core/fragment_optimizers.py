"""Each fragment's outer optimizer: the built-in Nesterov SGD or the user's (``outer.optimizer``), and its checkpoint.

`fragment_optimizer` builds one from the settings: ``OuterSettings.optimizer`` None is
policies.outer_optimizer.FragmentOuterOptimizer with ``outer.lr``/``momentum``/``partial_momentum``; a
callable or an import path ``package.module:function`` is policies.torch_outer_optimizer.TorchOuterOptimizer
over ``function(params)``, resolved and called only when the optimizer is first used.

Checkpoints (`save_optimizer`, `load_optimizer`): the built-in keeps its format, ``momentum/{name}``
tensors; a plug-in's ``state_dict()`` goes in as tensors ``outer_state/{fragment}/{index}/{key}`` (torch's
state index) and the rest (param groups, non-tensor state) as JSON in the metadata. A checkpoint of another
kind of optimizer than the run's restores the parameters and starts the optimizer's state afresh, with a
warning: refusing it would leave a restarted outer optimizer actor failing forever.

`check_outer_optimizer` is the preflight of a plug-in (orchestrator/run/workload.py ``prepare``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch

from islands.model_api import ModelError, resolve_callable
from orchestrator.core.settings import OuterSettings
from policies.outer_optimizer import FragmentOuterOptimizer
from policies.torch_outer_optimizer import TorchOuterOptimizer

__all__ = ["MOMENTUM_PREFIX", "OUTER_STATE_PREFIX", "check_outer_optimizer", "factory_name", "fragment_optimizer",
           "load_optimizer", "save_optimizer"]

log = logging.getLogger(__name__)

MOMENTUM_PREFIX = "momentum/"  # the built-in's momentum buffers, by parameter name
OUTER_STATE_PREFIX = "outer_state/"  # a plug-in's state tensors, by fragment, torch's index and key

FragmentOptimizer = FragmentOuterOptimizer | TorchOuterOptimizer


def factory_name(spec: Any) -> str:
    """How messages name an outer optimizer factory: its import path, else the callable's qualified name."""
    return spec.strip() if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def fragment_optimizer(params: Sequence[torch.Tensor], settings: OuterSettings) -> FragmentOptimizer:
    """The outer optimizer of one fragment's `params` (module docstring)."""
    spec = settings.optimizer
    if spec is None:
        return FragmentOuterOptimizer(params, lr=settings.lr, momentum=settings.momentum,
                                      partial_momentum=settings.partial_momentum)

    def build(fragment: list[torch.Tensor]) -> Any:
        make = resolve_callable(spec, "outer optimizer factory")  # here: a checkpoint-0 writer never imports it
        assert make is not None
        return make(fragment)

    return TorchOuterOptimizer(params, build, name=factory_name(spec))


def check_outer_optimizer(spec: Any, tensors: Sequence[torch.Tensor]) -> None:
    """Build the outer optimizer `spec` names over float32 copies of `tensors` (a few of the model's own) and step
    it once with zero gradients, as a round would; a ModelError in one line, naming the factory and the fix, if
    it does not resolve, raises, returns no ``torch.optim.Optimizer``, holds other tensors, cannot step or has a
    state a checkpoint cannot store."""
    if spec is None:
        return
    if not (isinstance(spec, str) or callable(spec)):
        raise ModelError(f"outer optimizer is a {type(spec).__name__}; pass a callable params -> "
                         "torch.optim.Optimizer or its import path 'package.module:function'")
    make = resolve_callable(spec, "outer optimizer factory")  # a path that does not resolve: ModelError already
    assert make is not None
    params = [t.detach().to(torch.float32).clone() for t in tensors]
    opt = TorchOuterOptimizer(params, make, name=factory_name(spec))
    try:
        opt.build()
    except ValueError as err:
        raise ModelError(str(err)) from err.__cause__
    try:
        opt.step([torch.zeros_like(p) for p in params])
    except Exception as err:  # noqa: BLE001 - the user's optimizer failed: one line, the traceback chained
        first = (str(err).strip().splitlines() or [""])[0]
        raise ModelError(f"outer optimizer {opt.name!r} raised {type(err).__name__} on a step: {first}; make its "
                         "step() work without a closure on gradients set as .grad") from err
    try:  # what a checkpoint will write: its tensors apart, the rest as JSON
        json.dumps(save_optimizer(opt, 0, [str(i) for i in range(len(params))], {}))
    except (TypeError, ValueError) as err:
        raise ModelError(f"outer optimizer {opt.name!r} has a state_dict() that a checkpoint cannot store ({err}); "
                         "keep its state and param groups to tensors, numbers, strings, lists and dicts") from err


def save_optimizer(opt: FragmentOptimizer, p: int, names: Sequence[str], tensors: dict[str, torch.Tensor]) -> Any:
    """Put fragment `p`'s optimizer state into `tensors`; return its JSON metadata (None for the built-in)."""
    if isinstance(opt, FragmentOuterOptimizer):
        for name, buf in zip(names, opt.momentum_buffers()):
            if buf is not None:
                tensors[MOMENTUM_PREFIX + name] = buf.clone()
        return None
    state = opt.state_dict()
    if not state:
        return None  # never built: nothing to restore but a fresh optimizer
    torch_state = state["torch"]
    plain: dict[str, dict[str, Any]] = {}
    for index, entries in torch_state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OUTER_STATE_PREFIX}{p}/{index}/{key}"] = value.detach().clone()
            else:
                plain.setdefault(str(index), {})[key] = value
    groups = []
    for g, group in enumerate(torch_state["param_groups"]):
        entry = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):  # a tensor lr, say
                tensors[f"{OUTER_STATE_PREFIX}{p}/group{g}/{key}"] = value.detach().clone()
            else:
                entry[key] = value
        groups.append(entry)
    return {"kind": state["kind"], "param_groups": groups, "state": plain,
            "indices": sorted(int(i) for i in torch_state["state"])}


def load_optimizer(opt: FragmentOptimizer, p: int, names: Sequence[str], tensors: dict[str, torch.Tensor],
                   meta: Any) -> None:
    """Restore what `save_optimizer` wrote for fragment `p`; another kind of optimizer's state starts afresh."""
    if isinstance(opt, FragmentOuterOptimizer):
        if meta is not None:
            log.warning("fragment %d: the checkpoint holds a %s's outer state, the run the built-in Nesterov SGD; "
                        "it starts with no momentum", p, meta.get("kind"))
        opt.load_momentum([tensors.get(MOMENTUM_PREFIX + n) for n in names])
        return
    if meta is None:
        if any(MOMENTUM_PREFIX + n in tensors for n in names):
            log.warning("fragment %d: the checkpoint holds the built-in SGD's momentum, the run outer optimizer %r; "
                        "its state starts afresh", p, opt.name)
        return
    # This fragment's tensors by what follows the prefix: "{index}/{key}" or "group{g}/{key}".
    prefix = f"{OUTER_STATE_PREFIX}{p}/"
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in tensors.items():
        if k.startswith(prefix):
            owner, _, key = k[len(prefix):].partition("/")
            saved.setdefault(owner, {})[key] = t
    state = {index: {**meta["state"].get(str(index), {}), **saved.get(str(index), {})} for index in meta["indices"]}
    groups = [{**group, **saved.get(f"group{g}", {})} for g, group in enumerate(meta["param_groups"])]
    try:
        opt.load_state_dict({"kind": meta["kind"], "torch": {"state": state, "param_groups": groups}})
    except ValueError as err:  # another optimizer class, or other groups: torch's own check
        log.warning("fragment %d: the checkpoint's outer optimizer state does not fit %r (%s); it starts afresh",
                    p, opt.name, err)
