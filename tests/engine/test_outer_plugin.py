"""A torch optimizer as the outer step, through the real outer optimizer core (no Ray).

Islands submit, rounds close and the ledger adds up with a plug-in (outer.optimizer); torch's Nesterov SGD as a
plug-in ends where the built-in does; a checkpoint of a plug-in's state, through the checkpoint store, gives a
fresh core bitwise the same next rounds; a bad factory is one ConfigError line before Ray starts.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.config import ConfigError, RunConfig, load_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.core.fragment_optimizers import OUTER_STATE_PREFIX
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.run.workload import Workload, _check_outer_optimizer
from policies.fragments import plan_fragments
from policies.torch_outer_optimizer import TorchOuterOptimizer
from tests.engine.nano import feed_rounds
from tests.from_config import outer_from_config

SHAPES = {"a": (16, 8), "b": (32,), "c": (8, 4), "bn.running_mean": (4,)}
BUFFERS = frozenset({"bn.running_mean"})
PATH = "tests.engine.test_outer_plugin:adam"


def adam(params):
    """The plug-in of these tests, by import path."""
    return torch.optim.Adam(params, lr=0.05, betas=(0.9, 0.99))


def nesterov(params):
    """torch's SGD with the built-in's hyperparameters."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _core(optimizer=None, islands: int = 3, outer: dict | None = None, **overrides) -> OuterOptimizer:
    """A core over SHAPES (one trained buffer) with `islands` registered; `optimizer` an import path (through the
    config) or a callable (as the API gives it), None the built-in."""
    init = {n: torch.linspace(-1, 1, int(torch.tensor(s).prod())).reshape(s) for n, s in SHAPES.items()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    outer = dict(outer or {})
    if isinstance(optimizer, str):
        outer["optimizer"] = optimizer
    elif optimizer is not None:
        overrides["optimizer"] = optimizer
    core = OuterOptimizer(init, plan, settings=outer_from_config({"outer": outer}, grace_gamma=0.0, **overrides),
                          buffer_names=BUFFERS)
    for island in range(islands):
        core.register(island, 1)
    return core


def test_a_plugin_merges_partial_rounds_and_the_ledger_adds_up():
    core = _core(PATH, poison_guard=True)  # the guard reads Adam's first moment as the fragment's momentum
    assert all(isinstance(o, TorchOuterOptimizer) for o in core._opts)
    buffer_before = core.global_parameters()["bn.running_mean"]
    sent = feed_rounds(core, rounds=5)
    core.close_all(now=10.0)
    ledger = core.ledger()
    assert sum(ledger["merged"]) == sent and sum(ledger["refused"]) == 0 and sum(ledger["pending"]) == 0
    assert not core.refusals
    partial = [r.step_scale for r in core.rounds if r.reason != "final flush" and r.step_scale < 1]
    assert partial, "K = 1 among 3 islands should close partial rounds"
    assert all(o.momentum_buffers()[0] is not None for o in core._opts)
    assert all(g["lr"] == 0.05 for o in core._opts for g in o.optimizer.param_groups)
    # The trained buffer got the islands' means and never a torch step (no Adam state).
    assert not torch.equal(core.global_parameters()["bn.running_mean"], buffer_before)
    frag = next(p for p, names in enumerate(core.plan.fragments) if "bn.running_mean" in names)
    index = core.plan.fragments[frag].index("bn.running_mean")
    assert core._opts[frag].momentum_buffers()[index] is None


def test_torch_nesterov_sgd_through_the_core_ends_where_the_builtin_does():
    builtin, plugin = _core(min_quorum=3), _core(nesterov, min_quorum=3)  # K = all 3: full rounds
    for core in (builtin, plugin):
        feed_rounds(core, rounds=4)
    assert all(r.step_scale == 1.0 for r in plugin.rounds) and len(plugin.rounds) == 8
    assert [r.participants for r in builtin.rounds] == [r.participants for r in plugin.rounds]
    a, b = builtin.global_parameters(), plugin.global_parameters()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_plugins_checkpoint_gives_a_fresh_core_the_same_next_rounds(tmp_path):
    core = _core(PATH)
    feed_rounds(core, rounds=3)
    tensors, meta = core.state_dict()
    assert any(k.startswith(OUTER_STATE_PREFIX) for k in tensors) and not any(k.startswith("momentum/") for k in tensors)
    assert meta["outer_state"][0]["kind"] == "Adam"
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(1, tensors, {"outer": meta})
    saved = store.load_latest()
    assert saved is not None
    fresh = _core(PATH)
    fresh.load_state_dict(saved.tensors, saved.meta["outer"])
    for p in range(core.plan.num_fragments):
        for x, y in zip(core._opts[p].momentum_buffers(), fresh._opts[p].momentum_buffers()):
            assert (x is None and y is None) or torch.equal(x, y)
    feed_rounds(core, rounds=2, seed=7, start=3)
    feed_rounds(fresh, rounds=2, seed=7, start=3)
    a, b = core.global_parameters(), fresh.global_parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_checkpoint_of_the_other_kind_starts_the_optimizer_afresh(caplog):
    builtin = _core()
    feed_rounds(builtin, rounds=2)
    tensors, meta = builtin.state_dict()
    assert "outer_state" not in meta  # the built-in's checkpoint is as it always was
    plugin = _core(PATH)
    plugin.load_state_dict(tensors, meta)
    assert "its state starts afresh" in caplog.text
    assert plugin.global_parameters().keys() == builtin.global_parameters().keys()
    assert all(torch.equal(plugin.global_parameters()[n], t) for n, t in builtin.global_parameters().items())


def test_a_checkpoint_zero_writer_never_calls_the_factory():
    called = []
    core = _core(lambda p: called.append(1) or torch.optim.SGD(p, lr=1.0))
    tensors, meta = core.state_dict()
    assert called == [] and "outer_state" not in meta


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


@pytest.mark.parametrize("spec, message", [
    ("nowhere.at_all:make", "cannot import module 'nowhere.at_all' of outer optimizer factory"),
    ("torch.optim:Adamw", "did you mean 'AdamW'"),
    ("tests.engine.test_outer_plugin:SHAPES", "is an object of type dict, not a callable"),
    (lambda p: "sgd", "returned a str, not a torch.optim.Optimizer"),
    (lambda p: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0), "holds 1 tensors, not the 2 parameters"),
    (lambda p: torch.optim.LBFGS(p), "raised TypeError on a step"),
    (3, "outer optimizer is a int; pass a callable"),
    (lambda p: torch.optim.SGD([{"params": p, "note": object()}], lr=1.0), "a checkpoint cannot store"),
])
def test_a_bad_outer_optimizer_is_one_config_error_line_before_ray(spec, message):
    # workload.prepare's check, before Ray: the factory built over two of the model's own parameters and stepped.
    with pytest.raises(ConfigError) as err:
        _check_outer_optimizer(RunConfig(), Workload(outer_optimizer=spec), _model())
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_the_apis_outer_optimizer_refuses_the_builtins_settings_beside_it():
    cfg = RunConfig(outer={"lr": 0.5})
    with pytest.raises(ConfigError, match=r"^outer.lr=0.5 has no effect: outer_optimizer='adam' replaces the built-in"):
        _check_outer_optimizer(cfg, Workload(outer_optimizer=adam), _model())
    _check_outer_optimizer(RunConfig(), Workload(outer_optimizer=adam), _model())
    _check_outer_optimizer(load_config(None, [f"outer.optimizer={PATH}"]), None, _model())


def test_the_apis_callable_travels_by_value_and_the_run_records_its_import_path():
    import ray.cloudpickle  # what Ray pickles an actor's arguments with; Ray itself is not started

    from orchestrator.run.workload import recorded_config

    lr = 0.3
    settings = outer_from_config(optimizer=lambda p: torch.optim.SGD(p, lr=lr))  # a closure: no import path
    shipped = ray.cloudpickle.loads(ray.cloudpickle.dumps(settings))
    assert shipped.optimizer([torch.zeros(2)]).param_groups[0]["lr"] == 0.3
    assert recorded_config(RunConfig(), Workload(outer_optimizer=adam)).outer.optimizer == PATH
    assert recorded_config(RunConfig(), Workload(outer_optimizer=PATH)).outer.optimizer == PATH
