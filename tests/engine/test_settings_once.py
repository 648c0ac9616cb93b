"""Each setting is declared once, in the config: the runtime settings classes carry no defaults of their own,
and the builders in orchestrator.settings fill every field from the config.

Before this, OuterSettings, InnerSettings and IslandSpec each repeated the config's defaults, and two drifted
(IslandSpec.adoption was "overwrite" while the config's is "rebase"; health.salvage_every_steps was 0 there and
5 in the config). These tests fail when a field grows a default the config does not own, when a builder
stops taking a field from the config, or when an engine signature gives a parameter named like a config field
a default that no list here explains.
"""

from __future__ import annotations

import dataclasses

import pytest

from islands.builtin import ByteTransformerFactory
from islands.island import LearnerIsland
from islands.spec import InnerSettings, IslandSpec, ModelRecipe
from orchestrator.actors.monitor_settings import HealthThresholds, MonitorPools, MonitorTimeouts, RunAddress
from orchestrator.config import ConfigError, PoolConfig, RunConfig, build_config
from orchestrator.core.settings import CheckpointSettings, OuterSettings
from orchestrator.settings import (
    injector_join_nodes,
    inner_settings,
    island_specs,
    model_recipe,
    monitor_health,
    monitor_pools,
    monitor_restart,
    monitor_timeouts,
    outer_checkpoints,
    outer_settings,
)
from policies.fragments import plan_fragments
from policies.sync_schedule import check_fragments_divide_h
from tests.engine.nano import nano_world
from tests.engine.test_config_reference import ALL as CONFIG_FIELDS
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

RUNTIME_SETTINGS = (OuterSettings, CheckpointSettings, InnerSettings, IslandSpec, ModelRecipe, HealthThresholds,
                    MonitorTimeouts, MonitorPools, RunAddress)

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

# A parameter of the engine (orchestrator/, islands/, policies/) named like a config field, with a default, is
# a default declared a second time: it can drift from the config's, and some had (HealthMonitor(warm_spares=0)
# against health.warm_spares 1, _OuterShell(checkpoint_every_s=30.0) against checkpoint.every_s 15). Take the
# value from the caller, which takes it from orchestrator/settings.py, or list the parameter below with its
# reason. Keys: (module path, function's qualified name, parameter).
ENGINE_FOLDERS = ("orchestrator", "islands", "policies")
CONFIG_NAMES = frozenset(dotted.rsplit(".", 1)[-1] for dotted, _ in CONFIG_FIELDS)
Key = tuple[str, str, str]

# Named like a config field, but another setting than the config's.
OTHER_SETTING: dict[Key, str] = {
    ("orchestrator/actors/chaos_injector.py", "ChaosInjector.__init__", "tick_s"): "the injector's own poll period, not health.tick_s",
    ("orchestrator/actors/health_monitor.py", "HealthMonitor.__init__", "data"): "[ref to the corpus], not the data: section",
    ("orchestrator/actors/health_monitor.py", "HealthMonitor.ensure_started", "data"): "[ref to the corpus], not the data: section",
    ("orchestrator/deploy/dashboard.py", "load_dashboard", "path"): "the Grafana dashboard's file, not data.path",
    ("orchestrator/deploy/dashboard.py", "run_metric_definitions", "source"): "the metrics module's file, not data.source",
    ("orchestrator/deploy/dashboard.py", "install_dashboard", "source"): "the Grafana dashboard's file, not data.source",
    ("orchestrator/run/progress.py", "ProgressPrinter.__init__", "every_s"): "how often progress lines print, not checkpoint.every_s",
    ("orchestrator/run/streams.py", "corpus_index", "path"): "a copy of the corpus to index instead (None: the config's), not data.path",
    ("orchestrator/run/trackers.py", "WandbCallback.__init__", "mode"): "the W&B client's mode, not the run's mode",
    ("orchestrator/run/workload.py", "_check_sizes", "batch_size"): "the probe batch of a size check, not data.batch_size",
    ("orchestrator/tune.py", "tune_trainable", "resources"): "a Tune trial's resources, not pools[].resources",
    ("orchestrator/tune.py", "diloco_trainable", "resources"): "a Tune trial's resources, not pools[].resources",
    ("islands/sampling.py", "generate", "seed"): "a sample's seed, not run.seed",
    ("islands/trainer.py", "InnerTrainer.__init__", "shard"): "whether this trainer's model is sharded (a bool), not pools[].shard",
    ("islands/data.py", "load_parquet_corpus", "seq_len"): "a lower bound for a library call, not model.seq_len",
    ("islands/data.py", "tokenize_corpus", "seq_len"): "a lower bound for a library call, not model.seq_len",
    ("islands/data.py", "load_parquet_corpus", "vocab_size"): "the byte vocabulary of the library call, not data.vocab_size",
    ("islands/data.py", "unigram_bits_per_byte", "vocab_size"): "the byte vocabulary of the library call, not data.vocab_size",
    ("policies/chaos.py", "fixed_tape", "seed"): "the tape's own seed (a chaos.params key), not run.seed",
    ("policies/chaos.py", "fixed_budget_tape", "seed"): "the tape's own seed (a chaos.params key), not run.seed",
    # Dataclass fields named like a config field: records and readings, not settings.
    ("orchestrator/actors/launcher.py", "RunActors.__init__", "islands"): "the run's island actors found by name, not pools[].islands",
    ("orchestrator/actors/slots.py", "SlotState.__init__", "name"): "the live incarnation's actor name, not pools[].name",
    ("orchestrator/core/rounds.py", "RoundRecord.__init__", "step_scale"): "the factor a round applied (a record), not outer.step_scale",
    ("orchestrator/run/driver.py", "Progress.__init__", "islands"): "each island's progress reading, not pools[].islands",
    ("islands/spec.py", "IslandStatus.__init__", "lr"): "the inner rate of the island's next step (a reading), not inner.lr",
    ("islands/stream.py", "TokenStream.__init__", "source"): "a description of the data for logs, not data.source",
    ("islands/corpus.py", "CorpusFormat.__init__", "vocab_size"): "the bound ids are checked against (None: unchecked), data.vocab_size for token corpora",
    ("policies/compressor.py", "Compressed.__init__", "keep"): "top-k's entries kept per chunk on the wire, not checkpoint.keep",
    # The simulator's job (diloco simulate and its flags), a model of a 1.2M-chip run, not this run's config.
    ("orchestrator/simulator/goodput.py", "SimConfig.__init__", "min_quorum"): "the simulated job's quorum (diloco simulate --min-quorum)",
    ("orchestrator/simulator/goodput.py", "SimConfig.__init__", "grace_gamma"): "the simulated job's grace (diloco simulate)",
    ("orchestrator/simulator/goodput.py", "SimConfig.__init__", "grace_cap_s"): "the simulated job's grace cap (diloco simulate)",
    ("orchestrator/simulator/goodput.py", "SimConfig.__init__", "tau_steps"): "the simulated job's grace window in steps (diloco simulate)",
    ("orchestrator/simulator/goodput.py", "SimConfig.__init__", "seed"): "the simulation's seed (diloco simulate --seed), not run.seed",
    # islands.spec.ModelConfig is the built-in model's shape as a library: PRESETS are built from it, and the config's
    # model.seq_len/d_model/... (None: the preset's) override a preset through model_config(), never these defaults.
    ("islands/spec.py", "ModelConfig.__init__", "vocab_size"): "the byte vocabulary (256) of the library's model; the engine passes the run's",
    ("islands/spec.py", "ModelConfig.__init__", "seq_len"): "the library model's shape; the config names a preset and its overrides",
    ("islands/spec.py", "ModelConfig.__init__", "d_model"): "the library model's shape; the config names a preset and its overrides",
    ("islands/spec.py", "ModelConfig.__init__", "n_layers"): "the library model's shape; the config names a preset and its overrides",
    ("islands/spec.py", "ModelConfig.__init__", "n_heads"): "the library model's shape; the config names a preset and its overrides",
}
# None = take the config's value: the public API's Python objects in place of the config's import paths.
THE_CONFIGS: dict[Key, str] = {
    ("orchestrator/settings.py", "outer_settings", "optimizer"): "the API's outer optimizer factory, else outer.optimizer",
    ("orchestrator/settings.py", "model_recipe", "model"): "the API's model factory, else model.factory",
    ("orchestrator/settings.py", "model_recipe", "loss"): "the API's loss, else model.loss",
    ("orchestrator/settings.py", "model_recipe", "optimizer"): "the API's inner optimizer, else model.optimizer",
    ("orchestrator/run/setup.py", "start_outer", "optimizer"): "the API's outer optimizer factory, else outer.optimizer",
    ("orchestrator/api.py", "DilocoTrainer.__init__", "model"): "the API's model factory, else model.factory",
    ("orchestrator/api.py", "DilocoTrainer.__init__", "optimizer"): "the API's inner optimizer, else model.optimizer",
    ("orchestrator/api.py", "Result.load_model", "model"): "a model factory, else the run's recorded model.factory",
    ("orchestrator/run/trained.py", "load_trained", "model"): "a model factory, else the run's recorded model.factory",
    ("orchestrator/run/trained.py", "evaluate_trained", "loss"): "a loss, else the run's recorded model.loss",
    ("orchestrator/tune.py", "diloco_trainable", "model"): "DilocoTrainer's model argument, passed on",
    ("orchestrator/tune.py", "diloco_trainable", "optimizer"): "DilocoTrainer's optimizer argument, passed on",
    ("orchestrator/api.py", "Result.__init__", "factory"): "the model factory fit() was given, else the recorded model.factory",
    ("orchestrator/run/workload.py", "Workload.__init__", "model"): "the API's model factory, else model.factory",
    ("orchestrator/run/workload.py", "Workload.__init__", "loss"): "the API's loss, else model.loss",
    ("orchestrator/run/workload.py", "Workload.__init__", "optimizer"): "the API's inner optimizer, else model.optimizer",
    ("orchestrator/baselines/data_parallel.py", "WorkerSlot.__init__", "precision"): "the pool's pools[].precision, else inner.precision (always passed)",
}
# A documented default of the pure API (policies/, islands/ library calls) equal to the config field's, which
# test_policy_defaults_are_the_configs checks: it cannot drift. The engine passes the config's value anyway.
SAME_AS_CONFIG: dict[Key, str] = {
    ("policies/outer_optimizer.py", "FragmentOuterOptimizer.__init__", "lr"): "outer.lr",
    ("policies/outer_optimizer.py", "FragmentOuterOptimizer.__init__", "momentum"): "outer.momentum",
    ("policies/restart.py", "RestartBudget.__init__", "reset_after_s"): "health.reset_after_s",
    ("policies/restart.py", "RestartBudget.__init__", "max_restarts"): "health.max_restarts",
    ("policies/restart.py", "RestartBudget.__init__", "reset_on_submission"): "health.reset_on_submission",
    ("policies/health.py", "hang_timeout_s", "startup_s"): "health.startup_s",
    ("policies/health.py", "assess_island", "startup_s"): "health.startup_s",
    ("policies/health.py", "assess_island", "unreachable_s"): "health.unreachable_s",
    ("policies/weighting.py", "merge_weights", "staleness_discount"): "outer.staleness_discount",
    ("policies/network.py", "build_network", "hub_region"): "network.hub_region",
    ("islands/builtin.py", "as_recipe", "loss"): "model.loss",
    ("islands/tokenizer.py", "text_encoder", "vocab_size"): "data.vocab_size",
    ("islands/corpus.py", "index_token_files", "heldout_fraction"): "data.heldout_fraction",
    ("islands/corpus.py", "index_stdlib", "heldout_fraction"): "data.heldout_fraction",
    ("islands/corpus.py", "index_stdlib", "max_bytes"): "data.max_bytes",
    ("islands/data.py", "load_stdlib_corpus", "heldout_fraction"): "data.heldout_fraction",
    ("islands/data.py", "load_stdlib_corpus", "max_bytes"): "data.max_bytes",
    ("islands/data.py", "load_stdlib_corpus", "shuffle_documents"): "data.shuffle_documents",
    ("islands/data.py", "stdlib_texts", "heldout_fraction"): "data.heldout_fraction",
    ("islands/data.py", "stdlib_texts", "max_bytes"): "data.max_bytes",
    ("islands/data.py", "stdlib_texts", "shuffle_documents"): "data.shuffle_documents",
    ("islands/data.py", "load_parquet_corpus", "text_column"): "data.text_column",
    ("islands/data.py", "load_parquet_corpus", "token_column"): "data.token_column",
    ("islands/data.py", "load_parquet_corpus", "heldout_fraction"): "data.heldout_fraction",
    ("islands/data.py", "load_parquet_corpus", "shuffle_documents"): "data.shuffle_documents",
    ("islands/data.py", "parquet_texts", "heldout_fraction"): "data.heldout_fraction",
    ("islands/data.py", "parquet_texts", "shuffle_documents"): "data.shuffle_documents",
    ("islands/stream.py", "TokenStream.__init__", "block_batches"): "data.block_batches",
    ("islands/corpus.py", "CorpusFormat.__init__", "heldout_fraction"): "data.heldout_fraction",
}
# A default that differs from the config's and stays, with why; test_the_engine_passes_what_differs checks
# that the engine never relies on it.
DIFFERS_KEPT: dict[Key, str] = {
    ("policies/outer_optimizer.py", "FragmentOuterOptimizer.__init__", "partial_momentum"):
        "None = momentum, the optimizer's own neutral (outer.partial_momentum is 0.7); the policy's reference tests "
        "(tests/policies/test_outer_optimizer.py) build it without, and the engine always passes the config's",
    ("orchestrator/core/checkpoint.py", "CheckpointStore.__init__", "keep"):
        "None prunes nothing: a store opened to read; every writer of a run passes checkpoint.keep",
}
ALLOWED: dict[Key, str] = {**OTHER_SETTING, **THE_CONFIGS, **SAME_AS_CONFIG, **DIFFERS_KEPT}


def _is_record_class(node) -> bool:
    """A dataclass or NamedTuple: its annotated class attributes are its constructor's parameters."""
    import ast

    decorators = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    return (any(d.rsplit(".", 1)[-1] == "dataclass" for d in decorators)
            or any(ast.unparse(b).rsplit(".", 1)[-1] == "NamedTuple" for b in node.bases))


def defaults_named_like_config(source: str, names: frozenset[str] = CONFIG_NAMES) -> dict[tuple[str, str], str]:
    """(qualified function name, parameter) -> the default's source text, for every parameter of a function in
    `source` that is named like a config field and has a default (None included: it, too, can differ from the
    config's). A dataclass's or NamedTuple's fields are its `__init__`'s parameters."""
    import ast

    found: dict[tuple[str, str], str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if _is_record_class(child):
                    for st in child.body:
                        if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None
                                and st.target.id in names and "ClassVar" not in ast.unparse(st.annotation)):
                            found[(f"{prefix}{child.name}.__init__", st.target.id)] = ast.unparse(st.value)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                positional = a.posonlyargs + a.args
                pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                         *zip(a.kwonlyargs, a.kw_defaults)]
                for arg, default in pairs:
                    if default is not None and arg.arg in names:
                        found[(prefix + child.name, arg.arg)] = ast.unparse(default)
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def engine_defaults() -> dict[Key, str]:
    """`defaults_named_like_config` over every module of the engine, keyed (module path, function, parameter);
    orchestrator/config.py, where the defaults are declared, aside."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found: dict[Key, str] = {}
    for folder in ENGINE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == "orchestrator/config.py":
                continue
            for (function, param), default in defaults_named_like_config(path.read_text()).items():
                found[(rel, function, param)] = default
    return found


def unexplained(found: dict[Key, str], allowed: dict[Key, str] = ALLOWED) -> list[str]:
    """The defaults of `found` that no list above explains, as `path: function(param=default)`."""
    return [f"{path}: {function}({param}={default})" for (path, function, param), default in sorted(found.items())
            if (path, function, param) not in allowed]


def test_no_engine_signature_repeats_a_config_default():
    found = engine_defaults()
    new = unexplained(found)
    assert new == [], (f"{new}: a default for a setting the config declares; take it from the caller, which takes it "
                       "from orchestrator/settings.py, or list it above with its reason")
    gone = sorted(set(ALLOWED) - set(found))
    assert gone == [], f"{gone} no longer have a default: take them off the lists"
    # The repeats this test was written against, now declared once (the first two had drifted from the config).
    for fixed in [("orchestrator/actors/health_monitor.py", "HealthMonitor.__init__", "warm_spares"),
                  ("orchestrator/actors/health_monitor.py", "HealthMonitor.__init__", "health"),
                  ("orchestrator/actors/outer.py", "_OuterShell.__init__", "network"),
                  ("islands/trainer.py", "forward_backward", "precision")]:
        assert fixed not in found, fixed


def test_the_signature_check_fails_on_a_repeated_default():
    bad = """
class HealthMonitor:
    def __init__(self, *, warm_spares=0, health=None, other=3):
        def inner(keep=3):
            pass

async def save(uri, every_s=30.0, /, tick=1):
    pass

@dataclasses.dataclass(frozen=True)
class Settings:
    keep: int = 3
    other: int = 1
    every_s: ClassVar = None

class Plain:
    keep: int = 3
"""
    got = defaults_named_like_config(bad)
    assert got == {("HealthMonitor.__init__", "warm_spares"): "0", ("HealthMonitor.__init__", "health"): "None",
                   ("HealthMonitor.__init__.<locals>.inner", "keep"): "3", ("save", "every_s"): "30.0",
                   ("Settings.__init__", "keep"): "3"}  # a ClassVar is no field, a plain class has no such __init__
    found = {("orchestrator/actors/x.py", *key): default for key, default in got.items()}
    assert unexplained(found) == ["orchestrator/actors/x.py: HealthMonitor.__init__(health=None)",
                                  "orchestrator/actors/x.py: HealthMonitor.__init__(warm_spares=0)",
                                  "orchestrator/actors/x.py: HealthMonitor.__init__.<locals>.inner(keep=3)",
                                  "orchestrator/actors/x.py: Settings.__init__(keep=3)",
                                  "orchestrator/actors/x.py: save(every_s=30.0)"]
    assert unexplained(found, {("orchestrator/actors/x.py", *key): "why" for key in got}) == []


def _config_default(dotted: str):
    return dict(CONFIG_FIELDS)[dotted].get_default(call_default_factory=True)


@pytest.mark.parametrize("key", sorted(SAME_AS_CONFIG), ids=lambda k: f"{k[1]}-{k[2]}")
def test_policy_defaults_are_the_configs(key):
    import importlib
    import inspect

    path, function, param = key
    obj = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for part in function.split("."):
        obj = getattr(obj, part)
    default = inspect.signature(obj).parameters[param].default
    assert default == _config_default(SAME_AS_CONFIG[key]), (key, default)


def test_the_engine_passes_what_differs():
    import torch

    from orchestrator.core.fragment_optimizers import fragment_optimizer

    for cfg in (RunConfig(), build_config({"outer": {"lr": 0.5, "momentum": 0.8, "partial_momentum": 0.3}})):
        opt = fragment_optimizer([torch.zeros(2)], outer_settings(cfg))
        assert (opt._lr, opt._momentum, opt._partial_momentum) == (cfg.outer.lr, cfg.outer.momentum,
                                                                   cfg.outer.partial_momentum)
    assert RunConfig().outer.partial_momentum == 0.7  # differs from the policy's None: the engine must pass it


def test_the_actors_settings_follow_the_config():
    cfg = build_config({"checkpoint": {"every_s": 7.0, "keep": 5}, "health": {"warm_spares": 2},
                        "pools": [{"name": "a", "islands": 2, "cpus_per_island": 2, "workers_per_island": 2,
                                   "labels": {"zone": "x"}, "resources": {"tpu": 1}}, {"name": "b"}]})
    assert outer_checkpoints(cfg, "/c") == CheckpointSettings(uri="/c", every_s=7.0, keep=5)
    assert monitor_pools(cfg) == MonitorPools(pools=tuple(cfg.pools), warm_spares=2)
    a = {"labels": {"zone": "x"}, "resources": {"tpu": 1}, "num_cpus": 4}
    b = {"labels": {}, "resources": {}, "num_cpus": cfg.pools[1].cpus_per_island}
    assert injector_join_nodes(cfg) == {0: a, 1: a, 2: b}
    plain = RunConfig()
    assert (outer_checkpoints(plain, "/c").every_s, outer_checkpoints(plain, "/c").keep) == (
        plain.checkpoint.every_s, plain.checkpoint.keep)
    assert monitor_pools(plain).warm_spares == plain.health.warm_spares
