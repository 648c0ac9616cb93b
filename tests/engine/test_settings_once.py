"""Each setting is declared once, in the config: the runtime settings classes carry no defaults of their own,
and the builders in orchestrator.settings fill every field from the config.

Before this, OuterSettings, InnerSettings and IslandSpec each repeated the config's defaults, and two drifted
(IslandSpec.adoption was "overwrite" while the config's is "rebase"; health.salvage_every_steps was 0 there and
5 in the config). These tests fail when a field grows a default the config does not own, or when a builder
stops taking a field from the config.
"""

from __future__ import annotations

import dataclasses

import pytest

from islands.builtin import ByteTransformerFactory
from islands.island import LearnerIsland
from islands.spec import InnerSettings, IslandSpec, ModelRecipe
from orchestrator.actors.monitor_settings import HealthThresholds, MonitorTimeouts, RunAddress
from orchestrator.config import ConfigError, PoolConfig, RunConfig, build_config
from orchestrator.core.settings import OuterSettings
from orchestrator.settings import (
    inner_settings,
    island_specs,
    model_recipe,
    monitor_health,
    monitor_restart,
    monitor_timeouts,
    outer_settings,
)
from policies.fragments import plan_fragments
from policies.sync_schedule import check_fragments_divide_h
from tests.engine.nano import nano_world
from tests.engine.test_config_reference import ALL as CONFIG_FIELDS
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

RUNTIME_SETTINGS = (OuterSettings, InnerSettings, IslandSpec, ModelRecipe, HealthThresholds, MonitorTimeouts, RunAddress)

# Fields that may keep a default because the config does not own them, each with its reason. Empty today:
# even the run-only fields of IslandSpec (slot, incarnation, keeper) are set by the builder or the caller.
RUNTIME_ONLY_DEFAULTS: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("cls", RUNTIME_SETTINGS, ids=lambda c: c.__name__)
def test_runtime_settings_declare_no_defaults(cls):
    with_default = [f.name for f in dataclasses.fields(cls)
                    if (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                    and (cls.__name__, f.name) not in RUNTIME_ONLY_DEFAULTS]
    assert with_default == [], (f"{cls.__name__} declares defaults for {with_default}: declare the setting in "
                                f"orchestrator/config.py and fill it in orchestrator/settings.py")


def _tiny_plan():
    return plan_fragments([("w", 64), ("b", 64)], 2)


def test_outer_settings_are_the_config_outer_section():
    cfg = RunConfig()
    got = dataclasses.asdict(outer_settings(cfg))
    derived = {"min_quorum": cfg.min_quorum_count(), "tau_steps": cfg.outer.effective_tau_steps(),
               "tau_schedule": cfg.outer.tau_schedule(), "average_window": cfg.run.average_window,
               "elastic_slots": cfg.elastic_slots(), "fixed_slots": cfg.num_islands}
    for name, value in got.items():
        want = derived[name] if name in derived else getattr(cfg.outer, name)
        assert value == want, name
    assert got["tau_steps"] == cfg.outer.sync_every_steps / cfg.outer.num_fragments  # tau = H/P by default


def test_inner_settings_are_the_config_inner_section_and_the_pool():
    cfg = RunConfig()
    plain = PoolConfig(name="x")
    for pool in (None, *cfg.pools):
        got = dataclasses.asdict(inner_settings(cfg, pool))
        source = pool or plain  # no pool: PoolConfig's own (no emulation)
        derived = {"batch_size": cfg.data.batch_size, "precision": cfg.precision_of(source),
                   "emulated_slowdown": source.emulated_slowdown, "emulated_jitter": source.emulated_jitter}
        for name, value in got.items():
            assert value == (derived[name] if name in derived else getattr(cfg.inner, name)), (pool, name)


def test_island_specs_are_the_config_pools_outer_and_health_sections():
    cfg, plan = RunConfig(), _tiny_plan()
    specs = island_specs(cfg, None, plan)
    assert [s.island for s in specs] == list(range(cfg.num_islands))
    assert [s.pool for s in specs] == [p.name for p in cfg.pools for _ in range(p.islands)]
    pool_of = {p.name: p for p in cfg.pools}
    for s in specs:
        pool = pool_of[s.pool]
        derived = {"island": s.island, "incarnation": 1, "pool": pool.name, "num_islands": cfg.num_islands,
                   "model": None, "plan": plan, "inner": inner_settings(cfg, pool),
                   "sync_every_schedule": tuple(tuple(e) for e in cfg.outer.sync_every_schedule),
                   "seed": cfg.run.seed, "workers": pool.workers_per_island, "shard": pool.shard, "accelerator": pool.accelerator,
                   "salvage_every_steps": cfg.health.salvage_every_steps, "keeper": None}
        for f in dataclasses.fields(IslandSpec):
            want = derived[f.name] if f.name in derived else getattr(cfg.outer, f.name)
            assert getattr(s, f.name) == want, f.name
    # The two values that had drifted from the config in IslandSpec's own defaults.
    assert specs[0].adoption == "rebase" and specs[0].salvage_every_steps == 5


def test_every_outer_and_island_setting_follows_a_changed_config():
    # int2 up and topk differences down: formats under which block size, density and feedback decay all act
    # (a config that gives them under formats that ignore them is refused: test_config.py).
    changed = {"outer": {"compression_block_size": 128, "adoption": "overwrite", "topk_density": 0.25,
                         "compression": "int2", "downlink_delta": "topk",
                         "feedback_decay": 0.5, "sync_every_steps": 12, "num_fragments": 3, "publish_to": "participants"},
               "inner": {"lr": 1e-2, "precision": "bf16"}, "data": {"batch_size": 3},
               "health": {"salvage_every_steps": 0}, "run": {"seed": 4, "average_window": 0.5},
               "pools": [{"name": "a", "workers_per_island": 2}]}
    cfg = build_config(changed)
    outer = outer_settings(cfg)
    assert (outer.compression_block_size, outer.topk_density, outer.publish_to, outer.average_window) == (
        128, 0.25, "participants", 0.5)
    assert outer.tau_steps == 4.0
    spec = island_specs(cfg, None, _tiny_plan(), run_id="r")[0]
    assert (spec.compression_block_size, spec.adoption, spec.topk_density, spec.feedback_decay) == (
        128, "overwrite", 0.25, 0.5)
    assert (spec.sync_every_steps, spec.seed, spec.salvage_every_steps, spec.keeper) == (12, 4, 0, None)
    assert (spec.inner.lr, spec.inner.precision, spec.inner.batch_size) == (1e-2, "bf16", 3)
    assert spec.workers == 2
    fsdp = build_config({"health": {"salvage_every_steps": 0}, "pools": [{"name": "a", "workers_per_island": 2, "shard": "fsdp"}]})
    assert island_specs(fsdp, None, _tiny_plan(), run_id="r")[0].shard == "fsdp"


def test_model_recipe_is_the_config_model_section_unless_the_api_passes_objects():
    cfg = RunConfig()
    built_in = model_recipe(cfg)
    assert built_in == ModelRecipe(model=ByteTransformerFactory(cfg.model.shape()), loss=None, optimizer=None,
                                   seed=cfg.run.seed, seq_len=cfg.model.shape().seq_len)
    paths = build_config({"model": {"factory": "pkg.mod:make", "loss": "pkg.mod:loss", "optimizer": "pkg.mod:opt",
                                    "seq_len": 64}, "run": {"seed": 7}})
    got = model_recipe(paths)
    assert (got.model, got.loss, got.optimizer, got.seed, got.seq_len) == ("pkg.mod:make", "pkg.mod:loss", "pkg.mod:opt", 7, 64)

    def mine():
        return None

    assert model_recipe(paths, model=mine, loss=len).model is mine and model_recipe(paths, loss=len).loss is len


def test_monitor_settings_are_the_config_health_section():
    cfg = RunConfig()
    h = cfg.health
    assert monitor_health(cfg) == HealthThresholds(factor=h.hang_factor, floor_s=h.hang_floor_s,
                                                   startup_s=h.startup_s, unreachable_s=h.unreachable_s)
    budget = monitor_restart(cfg)
    assert (budget.base_s, budget.cap_s, budget.reset_after_s, budget.max_restarts, budget.reset_on_submission) == (
        h.backoff_base_s, h.backoff_cap_s, h.reset_after_s, h.max_restarts, h.reset_on_submission)
    assert monitor_timeouts(cfg) == MonitorTimeouts(placement_s=cfg.run.placement_timeout_s,
                                                    call_s=cfg.run.call_timeout_s, tick_s=h.tick_s)
    changed = build_config({"health": {"hang_factor": 7.0, "backoff_cap_s": 99.0}})
    assert monitor_health(changed).factor == 7.0 and monitor_restart(changed).cap_s == 99.0


def test_the_test_helpers_take_the_config_and_name_their_overrides():
    assert outer_from_config() == outer_settings(RunConfig())
    assert outer_from_config({"outer": {"lr": 0.5}}).lr == 0.5
    assert inner_from_config(batch_size=2) == dataclasses.replace(inner_settings(RunConfig()), batch_size=2)
    spec = spec_from_config(model_config=None, plan=_tiny_plan(), island=3)
    assert spec.island == 3 and spec.adoption == RunConfig().outer.adoption


# ---- P | H: one check (policies.sync_schedule.check_fragments_divide_h), the config and the island call it


@pytest.mark.parametrize("h, p, pick", [(41, 2, 40), (40, 3, 39), (1, 2, 2)])
def test_fragments_must_divide_h(h, p, pick):
    with pytest.raises(ValueError, match=rf"^sync_every_steps \(H={h}\) must be a multiple of num_fragments "
                                         rf"\(P={p}\); pick H = {pick}$"):
        check_fragments_divide_h(h, p)
    check_fragments_divide_h(pick, p)


def test_the_config_and_the_island_refuse_h_with_the_same_words():
    with pytest.raises(ConfigError) as config_err:
        build_config({"outer": {"sync_every_steps": 9, "num_fragments": 2}})
    w = nano_world(outer_from_config())
    spec = spec_from_config(model_config=w.cfg, plan=w.plan, num_islands=1, sync_every_steps=9,
                            inner=inner_from_config(batch_size=2))
    with pytest.raises(ValueError) as island_err:
        LearnerIsland(spec, w.data, w.latest)
    assert str(island_err.value) in str(config_err.value)
    assert str(island_err.value) == "sync_every_steps (H=9) must be a multiple of num_fragments (P=2); pick H = 8"


def test_a_schedule_entry_names_itself():
    with pytest.raises(ValueError, match=r"^sync_every_schedule\[1\] has H = 5, not a multiple of num_fragments "
                                         r"\(P=2\); pick H = 4$"):
        check_fragments_divide_h(5, 2, where="sync_every_schedule[1]")


# ---- no config default repeated in an engine signature

# A parameter of the engine (orchestrator/, islands/) named like a config field, with a literal default, is a
# default declared a second time: it can drift from the config's (HealthMonitor(warm_spares=0) did, against 1).
# Share a constant the config also takes (islands/data_defaults.py), or take the value from the caller. Listed
# here: names that are another setting than the config field's, and the repeats still to remove (issue 58).
OTHER_SETTING = {
    ("orchestrator/actors/chaos_injector.py", "tick_s"): "the injector's own poll period, not health.tick_s",
    ("orchestrator/run/progress.py", "every_s"): "how often progress lines print, not checkpoint.every_s",
    ("orchestrator/run/trackers.py", "mode"): "the W&B client's mode, not chaos.mode",
    ("orchestrator/run/workload.py", "batch_size"): "the probe batch of a size check, not data.batch_size",
    ("islands/sampling.py", "seed"): "a sample's seed, not run.seed",
    ("islands/trainer.py", "shard"): "whether this trainer's model is sharded (a bool), not pools[].shard",
    ("islands/data.py", "seq_len"): "a lower bound for a library call, not model.seq_len",
    ("islands/data.py", "vocab_size"): "the byte vocabulary of the library call, not data.vocab_size (None there)",
}
STILL_REPEATED: dict[tuple[str, str], str] = {}


def repeated_defaults() -> set[tuple[str, str]]:
    """(module path, parameter) of engine signatures whose parameter is named like a config field and has a literal
    default other than None."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    names, found = {dotted.rsplit(".", 1)[-1] for dotted, _ in CONFIG_FIELDS}, set()
    for folder in ("orchestrator", "islands"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name == "config.py" and path.parent.name == "orchestrator":
                continue  # the declarations themselves
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
                for arg, default in pairs:
                    literal = isinstance(default, ast.Constant) and default.value is not None
                    if literal and arg.arg in names:
                        found.add((str(path.relative_to(root)), arg.arg))
    return found


def test_no_engine_signature_repeats_a_config_default():
    found = repeated_defaults()
    new = sorted(found - set(OTHER_SETTING) - set(STILL_REPEATED))
    assert new == [], (f"{new}: a literal default for a setting the config declares; take it from the caller or share "
                       "a constant with the config (islands/data_defaults.py), or list it above with its reason")
    gone = sorted((set(OTHER_SETTING) | set(STILL_REPEATED)) - found)
    assert gone == [], f"{gone} no longer have a literal default: take them off the lists"
    # The repeats this test was written against, now declared once (the first two had drifted from the config).
    for fixed in [("orchestrator/actors/health_monitor.py", "warm_spares"), ("orchestrator/actors/outer.py", "checkpoint_every_s"),
                  ("islands/data.py", "heldout_fraction"), ("islands/corpus.py", "heldout_fraction"),
                  ("islands/data.py", "shuffle_documents")]:
        assert fixed not in found, fixed
