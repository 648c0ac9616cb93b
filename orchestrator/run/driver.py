"""The run driver: builds a run from a RunConfig, starts the outer optimizer, the health monitor (which
places and keeps the islands) and the chaos injector, watches progress, evaluates the global
parameters, stops on the token budget and writes the run directory.

Run directory: `config.yaml` (resolved), `run.json` (run id, sessions), `checkpoints/`, `events/`
(Parquet event log), `summary.json`, `driver.log`. `train(..., resume=True)` continues a run whose
driver died: the outer optimizer restores its newest valid checkpoint and the islands restart from
their last merged data positions.

`Run` coordinates one session; its concerns live beside it: the token ledger (ledger.py), the evaluations
(evaluations.py), the control-plane actors (setup.py), the start-up wait (startup_wait.py), the stop rule
(stopping.py) and the summary of the session's record (results.py). Here too: the inner-step measurement the
emulated network is scaled to, the local Ray's start, and `train()`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import site
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from islands.builtin import as_recipe
from islands.spec import ModelConfig, ModelRecipe
from islands.trainer import InnerTrainer
from orchestrator.actors.chaos_injector import ChaosInjector
from orchestrator.actors.handles import call
from orchestrator.actors.health_monitor import HealthMonitor
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.remote import (
    WORKER_ENV,
    ignore_zero_copy_warnings,
)
from orchestrator.config import ConfigError, RunConfig
from orchestrator.core.evaluation import Evaluator
from orchestrator.core.eventlog import EventLog
from orchestrator.run.callbacks import Callback, Callbacks, RunInfo, check_callbacks, mean_train_loss
from orchestrator.run.evaluations import RunEvaluations
from orchestrator.run.ledger import SessionLedger, island_statuses
from orchestrator.run.metrics import RunMetrics
from orchestrator.run.notices import quiet_ray_notices
from orchestrator.run.preflight import preflight, resume_config
from orchestrator.run.results import SessionRecord, emulation_note, publish_outcome, run_summary
from orchestrator.run.setup import (
    kill_run_actors,
    prepare_run_dir,
    save_checkpoint_zero,
    start_injector,
    start_monitor,
    start_outer,
    start_timeout_s,
    stop_session,
)
from orchestrator.run.startup import Stage, StartupStages, placing_text
from orchestrator.run.startup_wait import wait_for_start
from orchestrator.run.stopping import INTERRUPTED, STOP_REQUEST, RunInterrupted, StopRequest, tick_stop
from orchestrator.run.streams import loss_unit
from orchestrator.run.workload import (
    TOKENIZER_FILE,
    Prepared,
    TrainingData,
    Workload,
    load_corpus,
    prepare,
    recorded_config,
    run_recipe,
    training_data,
)
from orchestrator.settings import injector_join_nodes, inner_settings, island_specs
from policies.chaos import tape_from_config
from policies.fragments import FragmentPlan, plan_fragments
from policies.network import NetworkModel, build_network

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# Re-exported: callers import these from the driver (the CLI, benchmarks, tests).
__all__ = [
    "Progress",
    "RayStartError",
    "Run",
    "Stage",
    "build_run_network",
    "check_local_fit",
    "emulation_note",
    "ensure_ray",
    "kill_run_actors",
    "load_corpus",
    "measure_step_s",
    "resume_config",
    "start_local_ray",
    "step_concurrency",
    "step_device",
    "train",
    "with_measured_step",
]

log = logging.getLogger(__name__)
_TRANSIENT = (RayActorError, RayTaskError, GetTimeoutError)


class RayStartError(RuntimeError):
    """A local Ray did not start, on the retry either; the message says what to do."""


class RunNotStarted(RuntimeError):
    """A run failed before its islands trained; its run directory was removed (the message says where
    driver.log went). The cause is chained."""


def _warn_transient(err: Exception) -> None:
    log.warning("control call failed (retrying): %s", str(err).strip().splitlines()[-1][:200])


@dataclass
class Progress:
    """What the driver knows at one moment, handed to the progress callback."""

    tokens: int
    budget: int
    versions: list[int]
    rounds: int
    train_loss: float | None
    eval_bpb: float | None
    elapsed_s: float
    islands: dict[str, str] = field(default_factory=dict)  # "pool/island" -> state
    unit: str = "token"  # what the losses are per: "byte" for text read as bytes (a token is a byte), else "token"


def progress_now(cfg: RunConfig, data: TrainingData, status: dict, snapshot: dict, *, tokens: int,
                 eval_bpb: float | None, elapsed_s: float) -> Progress:
    """The `Progress` of a run training on `data`, from the outer optimizer's `status` and the health monitor's
    `snapshot` of one tick, with the ledger's `tokens` processed and the latest held-out bits per byte."""
    return Progress(
        tokens=tokens, budget=cfg.run.token_budget, versions=status["versions"], rounds=status["rounds"],
        train_loss=mean_train_loss(island_statuses(snapshot)[0]), eval_bpb=eval_bpb, elapsed_s=elapsed_s,
        islands={f"{s['pool']}/{i}": s["state"] for i, s in snapshot["slots"].items()},
        unit=loss_unit(data.heldout) if data.is_tokens else "token",
    )


def step_concurrency(cfg: RunConfig, *, gpu: bool = False) -> int:
    """How many inner steps `measure_step_s` times side by side: `network.step_concurrency`, or by default
    every island worker of the config on a one-node Ray cluster (they share its cores) and 1 on a
    multi-node cluster (islands on their own machines). Timed on a GPU (`gpu`), only the GPU pools'
    workers count, spread over this machine's cards (islands that share a card share its time)."""
    if cfg.network.step_concurrency is not None:
        return cfg.network.step_concurrency
    alive = [node for node in ray.nodes() if node.get("Alive")] if ray.is_initialized() else []
    if len(alive) > 1:
        return 1
    workers = sum(p.islands * p.workers_per_island for p in cfg.pools if not gpu or p.accelerator != "cpu")
    return max(1, math.ceil(workers / max(1, torch.cuda.device_count()))) if gpu else workers


def measure_step_s(cfg: RunConfig, recipe: ModelRecipe | ModelConfig, train_data: Any, *, steps: int = 4,
                   concurrency: int | None = None) -> float:
    """Median compute time of one inner step of the model on this machine, as the run's islands will see it.

    The emulated network is scaled to it (policies.network), so it must be the step time of an island
    while the others step too: `concurrency` trainers (default `step_concurrency(cfg)`) step at once, one
    thread each with the islands' thread count, 2 warm-up steps each, before any island starts. Threads
    stand in for the island processes because torch releases the GIL inside its ops: on this 2-core
    machine 4 threads measured 0.287 s per step against 0.28 s for 4 processes and 0.12 s for one alone.
    """
    device = step_device(cfg)
    k = step_concurrency(cfg, gpu=device != "cpu") if concurrency is None else concurrency
    # In the timed pools' arithmetic (the first one's, when their precisions differ): a bf16 GPU step is
    # up to 3x shorter than an fp32 one, and the links follow the step.
    timed = [p for p in cfg.pools if device == "cpu" or p.accelerator != "cpu"]
    inner = replace(inner_settings(cfg), precision=cfg.precision_of(timed[0]))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.inner.torch_threads)
    try:
        trainers = [InnerTrainer(as_recipe(recipe, seed=cfg.run.seed), train_data, settings=inner, shard_index=i, num_shards=k, seed=cfg.run.seed,
                                 device=device) for i in range(k)]

        def run(trainer: InnerTrainer) -> list[float]:
            return [trainer.step().compute_s for _ in range(steps + 2)][2:]

        with ThreadPoolExecutor(max_workers=k) as pool:
            times = [t for ts in pool.map(run, trainers) for t in ts]
    finally:
        torch.set_num_threads(threads)
    step_s = sorted(times)[len(times) // 2]
    log.info("network scaling: inner step %.4f s on %s (median of %d steps, %d stepping side by side)", step_s,
             device, len(times), k)
    return step_s


def step_device(cfg: RunConfig) -> str:
    """Where `measure_step_s` times the step: a GPU when any pool trains on one (the links are scaled to
    the fastest islands' step; CPU pools of a mixed run are slower still), else the CPU.

    Raises ConfigError when GPU pools need a measurement this process cannot take (no CUDA here, e.g. a
    driver on a CPU head node): a CPU step, often 50x longer, would make the emulated links far too fast.
    Timing on a GPU leaves this process a CUDA context (a few hundred MB of the card) for the run.
    """
    gpu_pools = [p.name for p in cfg.pools if p.accelerator != "cpu"]
    if not gpu_pools:
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"network.scenario {cfg.network.scenario!r} scales its emulated links to the islands' step "
                          f"time, but pools {', '.join(gpu_pools)} train on GPUs and this driver has no CUDA to time "
                          f"their step; set network.local_step_s to their step time in seconds")
    return "cuda"


def with_measured_step(cfg: RunConfig, address: str | None, prepared: Prepared | None = None) -> RunConfig:
    """`cfg` with network.local_step_s measured now, when this driver is about to start a local Ray
    (no `address`, none running) for an emulated scenario that leaves it unset; else `cfg` as it is.

    Measured before ray.init: in the seconds after it, Ray's daemons and prestarted workers slowed the
    timed steps by up to 40% (0.35 s against 0.245 s for four islands on this machine). Joining a
    cluster, the run measures at setup instead (build_run_network). The measured value lands in the run
    directory's config.yaml, so a resumed run keeps the same links.
    """
    if (address is not None or ray.is_initialized() or cfg.network.scenario == "none"
            or cfg.network.local_step_s is not None):
        return cfg
    if prepared is None:
        data = training_data(cfg)
        step_s = measure_step_s(cfg, run_recipe(cfg, data), timing_data(data))
    else:
        step_s = measure_step_s(cfg, prepared.recipe, timing_data(prepared.data))
    return cfg.model_copy(update={"network": cfg.network.model_copy(update={"local_step_s": step_s})})


def timing_data(data: TrainingData) -> Any:
    """What `measure_step_s` steps on: for data the islands stream, its held-out tokens or examples (the driver never
    reads the training units; held-out batches have the same shape); else the data itself."""
    if data.is_streamed:
        if data.is_tokens:
            return data.heldout
        # Held-out examples, repeated: batches of the training data's shape, without reading a training example.
        held = data.heldout
        return [held[i % len(held)] for i in range(max(len(held), 1024))]
    return data.train


def build_run_network(cfg: RunConfig, model_bytes: int, step_s: Callable[[], float]) -> tuple[NetworkModel, dict[int, str]]:
    """The run's network model (cfg.network) and island -> region (its pool's), islands in pool order.

    `step_s` measures the inner-step time; it is only called for an emulated scenario without
    network.local_step_s. Raises ConfigError (one line) for a pool region the scenario lacks.
    """
    regions = {i: pool.region for i, pool in enumerate(p for p in cfg.pools for _ in range(p.islands))}
    n = cfg.network
    local_step_s = n.local_step_s if n.local_step_s is not None or n.scenario == "none" else step_s()
    try:
        network = build_network(n.scenario, [p.region for p in cfg.pools], model_bytes=model_bytes,
                                local_step_s=local_step_s or 0.0, hub_region=n.hub_region)
    except ValueError as err:
        raise ConfigError(f"network: {err}") from None
    return network, regions


def ensure_ray(cfg: RunConfig, address: str | None, *, init: Callable[..., Any] | None = None,
               prestart: bool = True) -> bool:
    """Connect to `address` or start a local Ray (retried once: `start_local_ray`); returns True when
    this call started or joined it. `init` stands in for ray.init (tests inject a failing start).
    `prestart`: a local Ray prestarts workers for this run's actors (local_system_config); False for a
    run whose actors are not ours (the data-parallel baseline's are Ray Train's, and would leave them idle)."""
    init = init or ray.init
    if ray.is_initialized():
        return False
    if address:
        init(address=address, runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
        return True
    # Logical CPUs may exceed physical cores: islands are throttled or small; Ray only counts.
    needed = math.ceil(sum(p.cpus_per_island * p.reserved_bundles(cfg.health.warm_spares) for p in cfg.pools))
    num_cpus = max(os.cpu_count() or 1, needed)
    # address="local": never join some other cluster running on this machine by accident. No job runtime env:
    # WORKER_ENV reaches the workers through the environment Ray's processes inherit, so that the run's first
    # actors (empty runtime env) can take the workers Ray prestarts (local_system_config).
    quiet_ray_notices()  # fit() as diloco train: no token-auth notice between the start-up lines
    with _environment(local_worker_env()):
        start_local_ray(init, address="local", num_cpus=num_cpus, include_dashboard=False,
                        logging_level=logging.WARNING,
                        _system_config=local_system_config(cfg, num_cpus) if prestart else _NO_PRESTART)
    return True


def local_system_config(cfg: RunConfig, num_cpus: int) -> dict[str, Any]:
    """Ray's system config for a local Ray this driver starts: prestarted workers that hold torch already.

    The raylet starts idle workers as soon as it is up, each importing torch and the island code
    (orchestrator/actors/preload.py) while Ray's own start leaves a core idle; the outer optimizer, the health
    monitor and the first islands then start in them, ready, not in new processes once every core is busy
    (benchmarks/RESULTS.md#startup-prestarted). Ray hands a prestarted worker only to an actor of an empty
    runtime env, hence none for the job (ensure_ray).

    How many: Ray prestarts one per logical CPU but never more at once than its start-up concurrency, so that
    concurrency sets the count: at most the actors that start before the first step (the outer optimizer, the
    monitor and every island worker), since an unused one would idle with torch loaded for the whole run. On 2
    cores that is 3 (the default config's CPUs); 6, one per such actor, made the first step later there. The
    bound holds for this Ray's later starts too (restarts, spares): at most that many processes start at once.
    """
    first_actors = 2 + sum(p.islands * p.workers_per_island for p in cfg.pools)
    return {"enable_worker_prestart": True, "preload_python_modules": ["orchestrator.actors.preload"],
            "worker_maximum_startup_concurrency": min(num_cpus, first_actors)}


def local_worker_env() -> dict[str, str]:
    """The environment a local Ray's processes inherit from this driver: WORKER_ENV, and PYTHONPATH led by the
    folder this project is imported from unless that is a site-packages folder.

    Why the path: a prestarted worker imports the preload module (orchestrator/actors/preload.py) at boot,
    before Ray gives it the driver's sys.path; a checkout run without `pip install` (`python -m
    orchestrator.cli` in it) would otherwise print a traceback per worker. An installed project needs nothing."""
    env = dict(WORKER_ENV)
    root = str(Path(__file__).resolve().parents[2])
    sites = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in sites:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


# Without prestarted workers for us, none at all: Ray would otherwise prestart some for the first driver, which
# actors of other runtime envs (Ray Train's) never take, idle for the whole run.
_NO_PRESTART = {"prestart_worker_first_driver": False}


@contextmanager
def _environment(env: dict[str, str]):
    """`env` set in this process's environment for the block (which starts Ray's processes: they inherit it),
    then restored, so that a notebook's own environment is left as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Retry of a local start. Ray 2.60 waits a fixed 30 s for the new node to register (ray/_private/node.py,
# "The current node timed out during startup": seen on a busy 2-core machine) and nothing lengthens that
# wait; the retry gives the start a second 30 s after a pause for the first attempt's processes to go, and
# triples the next timeout a busy machine trips, the workers' registration (60 s by default).
RAY_RETRY_PAUSE_S = 5.0
_RETRY_SYSTEM_CONFIG = {"worker_register_timeout_seconds": 180}


def start_local_ray(init: Callable[..., Any], *, pause_s: float = RAY_RETRY_PAUSE_S,
                    shutdown: Callable[[], None] | None = None, **kwargs: Any) -> None:
    """`init(**kwargs)` (ray.init starting a local Ray); a start that fails is retried once, after
    `pause_s`, with longer timeouts. Raises RayStartError (one line: the cause and what to do) when the
    retry fails too; TypeError/ValueError (bad arguments, not a busy machine) are not retried.
    `shutdown` (ray.shutdown) clears what a failed attempt left connected."""
    shutdown = shutdown or ray.shutdown
    try:
        init(**kwargs)
        return
    except (TypeError, ValueError):
        raise
    except Exception as err:  # noqa: BLE001 - Ray raises plain Exception for a node that did not start
        log.warning("the local Ray did not start (%s); retrying once with longer timeouts", _first_line(err))
    shutdown()
    time.sleep(pause_s)
    try:
        init(**{**kwargs, "_system_config": {**kwargs.get("_system_config", {}), **_RETRY_SYSTEM_CONFIG}})
    except Exception as err:
        shutdown()
        raise RayStartError(f"the local Ray did not start, twice ({_first_line(err)}); the machine is probably "
                            f"busy: let other jobs finish (`ray stop` ends a leftover local Ray) and run again, "
                            f"or pass --address of a running cluster") from err


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def check_local_fit(cfg: RunConfig) -> None:
    """Raise ConfigError (one line; the local Ray shut down) when the one-node Ray this driver started cannot
    host every pool (orchestrator.run.local_fit.local_problems), instead of waiting for placement forever."""
    from orchestrator.run.local_fit import local_problems

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    problems = local_problems(cfg, labels=dict(nodes[0].get("Labels") or {}) if nodes else {},
                              resources=ray.cluster_resources())
    if problems:
        ray.shutdown()
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)


@dataclass(frozen=True)
class World:
    """What one driver session trains, built from the prepared workload before any actor starts (`build_world`):
    the data, the model recipe and its state tensors' roles, the fragment plan, the network model with each
    island's region, the evaluator of the held-out batches and the chaos tape. The initial state tensors are
    not kept here: from checkpoint 0 on they are the outer optimizer's, and the driver holds them only until
    it has scored the starting point."""

    data: TrainingData
    recipe: ModelRecipe
    embedding_names: frozenset[str]
    buffer_names: frozenset[str]
    plan: FragmentPlan
    network: NetworkModel
    island_regions: dict[int, str]
    evaluator: Evaluator
    tape: Any


def build_world(cfg: RunConfig, prepared: Prepared) -> World:
    """The session's `World` from `prepared` (orchestrator/run/workload.py `prepare`), logged. The network's
    links are scaled to the inner step, measured here for an emulated scenario without network.local_step_s."""
    data, recipe, initial = prepared.data, prepared.recipe, prepared.initial
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], cfg.outer.num_fragments)
    model_bytes = sum(t.numel() * 4 for t in initial.values())  # float32 bytes: the network's scaling unit
    network, island_regions = build_run_network(cfg, model_bytes, lambda: measure_step_s(cfg, recipe, timing_data(data)))
    log.info("%s", network.describe())
    evaluator = Evaluator(recipe, data.heldout, batches=cfg.eval.batches, batch_size=cfg.eval.batch_size,
                          threads=cfg.inner.torch_threads)
    tape = tape_from_config(cfg.chaos.spec(), islands=cfg.num_islands, horizon_s=cfg.chaos.horizon_s)
    log.info("data: %s; model %s (%d state elements); %d fragments; %d faults on the tape",
             data.source, recipe.name, sum(t.numel() for t in initial.values()), plan.num_fragments, len(tape))
    return World(data=data, recipe=recipe, embedding_names=prepared.embedding_names, buffer_names=prepared.buffer_names,
                 plan=plan, network=network, island_regions=island_regions, evaluator=evaluator, tape=tape)


class Run:
    """One driver session of a training run, from placement to summary. `train()` is the entry point.

    Run coordinates, read top to bottom: the set-up (`_setup`), the loop (`_loop`, `_periodic`) and the finish
    (`_finish`). What it coordinates lives beside it: the session's `World` (`build_world`), its token ledger
    (`ledger`, orchestrator/run/ledger.py), its evaluations (`evals`, orchestrator/run/evaluations.py), the
    start-up wait (orchestrator/run/startup_wait.py) and the summary of the `SessionRecord` the finish hands
    over (orchestrator/run/results.py).
    """

    callbacks = Callbacks(None, None)  # none; __init__ sets the run's (a Run built without it, a test's, has none)
    world: World  # these three from the set-up on (_setup)
    ledger: SessionLedger
    evals: RunEvaluations
    # The run's actors, from the set-up on too (None until it started them: the clean-up reads them either way).
    outer: ActorHandle[_OuterShell]
    monitor: ActorHandle[HealthMonitor]
    injector: ActorHandle[ChaosInjector] | None  # a run with a fault tape's

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, progress: Callable[[Progress], None] | None = None,
                 resume: bool = False, stages: Callable[[Stage], None] | None = None,
                 workload: Workload | None = None, prepared: Prepared | None = None,
                 stop: StopRequest | None = None, callbacks: Sequence[Callback] | None = None) -> None:
        """`workload`: the public API's Python objects (model factory, loss, optimizer, datasets) in place of
        the config's import paths and data source; `prepared`: that workload already checked and built
        (orchestrator/run/workload.py `prepare`), else the run prepares it at setup; `stop`: asks the run to
        stop cleanly (orchestrator/run/stopping.py; `request_stop` asks it too); `callbacks`: called as the run goes
        (orchestrator/run/callbacks.py), before the trackers `cfg.run.trackers` names."""
        self.cfg = cfg
        self.workload = workload
        self.prepared = prepared
        # Absolute: the actors that write under it (the outer optimizer's checkpoints) run with the Ray
        # worker's working directory, not the driver's (a relative path broke a notebook that joined a
        # running cluster).
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.progress = progress
        self.startup = StartupStages(stages)  # start-up stages as they happen (orchestrator/run/startup.py)
        self.resume = resume
        self.run_id = f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self.events = EventLog(self.run_dir)
        self.outer = self.monitor = self.injector = None  # type: ignore[assignment]  # set up by _setup
        self.snapshot: dict = {"slots": {}, "timeline": [], "detect_s": [], "rejoin_s": []}
        self.stop = stop or StopRequest()
        self.training_began = False  # set once every island of the first placement trains
        self.stopped_by = "token_budget"
        self.metrics = RunMetrics(self.run_id)  # Prometheus metrics via ray.util.metrics (docs/metrics.md)
        if cfg.run.trackers:  # imported only then: the trackers' own packages are imported when they start
            from orchestrator.run.trackers import config_trackers

            callbacks = [*(callbacks or ()), *config_trackers(cfg.run.trackers)]
        self.callbacks = Callbacks(callbacks, RunInfo(run_dir=self.run_dir, run_id=self.run_id, config=cfg,
                                                      resumed=resume, request_stop=self.stop.ask))

    def request_stop(self) -> None:
        """Ask a running `train()` to finish now (from another thread, e.g. a notebook or a test)."""
        self.stop.ask(STOP_REQUEST)

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """Start the session: run directory, world, checkpoint 0, then the outer optimizer, the health monitor
        (which starts the islands) and the chaos injector, in the order that keeps start-up short."""
        cfg = self.cfg
        address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
        ckpt_uri = prepare_run_dir(cfg, self.run_dir, self.run_id, resume=self.resume, address=address)
        prepared = self.prepared or prepare(cfg, self.workload, self.run_dir)
        self.prepared = None  # the initial tensors are the outer optimizer's from here: do not keep a second copy
        world = self.world = build_world(cfg, prepared)
        self.ledger = SessionLedger(world.plan.num_fragments)
        self.evals = RunEvaluations(world.evaluator, world.data, self.events, self.callbacks)
        if world.data.encoder is not None:  # sample, evaluate and a resume decode and encode with this very tokenizer
            world.data.encoder.save(self.run_dir / TOKENIZER_FILE)
        if not self.resume:
            save_checkpoint_zero(cfg, prepared.initial, world.plan, ckpt_uri)
        self.startup("placing", placing_text(cfg))
        self.outer_name, self.outer = start_outer(
            cfg, self.run_id, ckpt_uri, plan=world.plan, embedding_names=world.embedding_names,
            buffer_names=world.buffer_names, network=world.network, island_regions=world.island_regions,
            optimizer=self.workload.outer_optimizer if self.workload else None)
        self._restore()
        specs = self.ledger.continue_incarnations(island_specs(cfg, world.recipe, world.plan, self.run_id))
        # A stream is the data plan, no tokens; a token array from Python goes in as one object per unit (with_refs).
        train = world.data.train
        self.data_ref = ray.put(train.with_refs(ray.put) if world.data.is_streamed else train)
        self.monitor_name, self.monitor = start_monitor(cfg, self.run_id, specs, self.outer_name)
        self._start_islands(prepared.initial)
        self.training_began = True  # from here a failure leaves a run directory worth keeping (train())
        # Goodput's clock starts when every island of the first placement trains (startup is the same
        # for every method and is reported apart in driver.log); the chaos tape counts from here too.
        self.run_start = time.time()
        if len(world.tape):
            self.injector = start_injector(world.tape, self.run_id, self.monitor_name, self.run_start,
                                           cfg.run.call_timeout_s, injector_join_nodes(cfg))

    def _restore(self) -> None:
        """A resumed run's starting point from the restored outer optimizer: the earlier sessions' token ledger as
        of its checkpoint and each island's last incarnation (SessionLedger.resume); a fresh run has none."""
        if not self.resume:
            # A fresh run has nothing to ask the outer optimizer first: the monitor (and through it the
            # islands) starts while the outer's process is still importing, not after it (~5 s per run).
            return
        extra = self._get(call(self.outer, _OuterShell.restored_extra), timeout=start_timeout_s(self.cfg))  # starts, restores
        acct = self._get(call(self.outer, _OuterShell.accounting))
        restored = self._get(call(self.outer, _OuterShell.status))["ledger"]  # the checkpoint's merged and refused
        self.ledger.resume(restored=restored, extra=extra, acct=acct)
        # Before any checkpoint of this session: each one carries this session's records.
        self._get(call(self.outer, _OuterShell.note, **self.ledger.note()))

    def _start_islands(self, initial: dict[str, torch.Tensor]) -> None:
        """Have the monitor start the islands and wait for them (and a fresh run's outer optimizer), reporting
        each island as it comes up; note the starting point to score."""
        started = call(self.monitor, HealthMonitor.ensure_started, fresh=not self.resume, data=[self.data_ref])
        # The starting point, how far the loss fell from. A fresh run evaluates the parameters it seeded
        # (version 0 of every fragment): asking the outer optimizer raced the islands, which on a quick
        # start had merged a few rounds before it answered (seen in a notebook). It is scored once an island
        # has stepped (RunEvaluations.score_start). A resumed run's islands start only below, so the outer's
        # restored parameters are the starting point, scored now.
        if self.resume:
            self._evaluate(time.monotonic())
            self.evals.score_unigram()
        else:
            self.evals.hold_start(initial, self.world.plan.num_fragments)
        # A fresh run's outer optimizer is up (or says why not) while islands start; a resumed run's was asked
        # for its metadata above.
        wait_for_start(started, [] if self.resume else [call(self.outer, _OuterShell.restored_extra)], cfg=self.cfg,
                       monitor=self.monitor, first_inc=self.ledger.first_inc, timeout_s=start_timeout_s(self.cfg),
                       get=self._get, stages=self.startup)

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        return ray.get(ref, timeout=timeout or self.cfg.run.call_timeout_s)

    # ------------------------------------------------------------------ loop

    def _refresh(self) -> None:
        self._get(call(self.monitor, HealthMonitor.ensure_started, data=[self.data_ref]))  # re-adopts islands after a monitor restart
        self.snapshot = self._get(call(self.monitor, HealthMonitor.snapshot))
        self.callbacks.island_events(self.snapshot, self.ledger.processed)

    def _accounting(self) -> dict:
        """The outer optimizer's accounting(), with what earlier reads saw (SessionLedger.keep_accounting)."""
        return self.ledger.keep_accounting(self._get(call(self.outer, _OuterShell.accounting)))

    def _evaluate(self, t0: float) -> dict:
        """Evaluate the run's model now: the global parameters, or their moving average under run.average_window.
        The point's token counts are the ledger's at this read, its `wall_s` (from `t0`) and `at` the read's."""
        read_mono, read_at = time.monotonic(), time.time()
        params = self._get(call(self.outer, _OuterShell.served_parameters))
        status = self._get(call(self.outer, _OuterShell.status))
        fates = self.ledger.account(status, self.snapshot)
        return self.evals.score(params, versions=list(status["versions"]), tokens=self.ledger.processed,
                                merged=sum(fates["merged"]) / len(fates["merged"]), wall_s=read_mono - t0, at=read_at)

    def _drain_events(self) -> int:
        """Take the rounds and refusals the outer optimizer recorded since the last call; returns how many rounds."""
        got = self._get(call(self.outer, _OuterShell.drain_events))
        self.events.add("rounds", got["rounds"])
        self.events.add("refusals", got["refusals"])
        self.metrics.record_events(got["rounds"], got["refusals"], self.snapshot)
        return len(got["rounds"])

    def _report(self, t0: float, status: dict) -> None:
        if self.progress is not None:
            self.progress(progress_now(self.cfg, self.world.data, status, self.snapshot, tokens=self.ledger.processed,
                                       eval_bpb=self.evals.last_bpb, elapsed_s=time.monotonic() - t0))

    def train(self) -> dict:
        """Run to the token budget (or max_wall_s, or a stop asked) and return the summary (also written to
        summary.json). A KeyboardInterrupt while it trains stops it the same way, `stopped_by` "interrupted"."""
        self.callbacks.start()
        self._setup()
        t0 = time.monotonic()
        try:
            self.stop.stoppable = True  # from here a stop asked (a signal, another thread) is a clean one
            self._loop(t0)
        except KeyboardInterrupt:  # Ctrl-C in the driver's thread (a notebook's fit()): the same clean stop
            self.stop.ask(INTERRUPTED)
            self.stopped_by = self.stop.reason or INTERRUPTED
            log.warning("interrupted: stopping cleanly (the islands' last progress merged, then a checkpoint); "
                        "interrupt again to stop at once")
        log.info("stopping: %s", self.stopped_by)
        return self._finish(t0)

    def _loop(self, t0: float) -> None:
        """Tick until a stop rule or a stop asked ends the run, setting `stopped_by`."""
        next_eval, next_flush = t0 + self.cfg.eval.interval_s, t0 + 5.0
        budget = self.cfg.run.token_budget
        while True:
            try:
                self._refresh()
                status = self._get(call(self.outer, _OuterShell.status))
                self.ledger.account(status, self.snapshot)
                incarnations = {str(i): s["incarnation"] for i, s in self.snapshot["slots"].items()}
                self._get(call(self.outer, _OuterShell.note, **self.ledger.note(), run_id=self.run_id, incarnations=incarnations,
                               progress=self.ledger.processed / budget))
                if self.injector is not None:  # a fixed tape's faults trigger on the run's progress: no reply awaited
                    call(self.injector, ChaosInjector.note_progress, self.ledger.processed / budget)
            except _TRANSIENT as err:  # an actor restarting: Ray brings it back, try again next tick
                _warn_transient(err)
                time.sleep(0.5)
                continue
            if not self.startup.first_step_seen:  # the islands' statuses are listed only until one has stepped
                self.startup.first_step(sorted(s.island for s in island_statuses(self.snapshot)[0] if s.steps > 0))
            self._report(t0, status)
            self.metrics.record_status(status, self.snapshot, ledger=self.ledger.current)
            now = time.monotonic()
            if self.evals.start_pending and (self.startup.first_step_seen or now >= next_eval):
                self.evals.score_start()  # before any periodic evaluation: the starting point comes first
            stopped_by = tick_stop(self.stop.reason, processed=self.ledger.processed, budget=budget, elapsed_s=now - t0,
                                   max_wall_s=self.cfg.run.max_wall_s)
            if stopped_by is not None:
                self.stopped_by = stopped_by
                break
            next_eval, next_flush, stop = self._periodic(t0, now, next_eval, next_flush, status)
            if stop:
                break
            time.sleep(0.5)

    def _periodic(self, t0: float, now: float, next_eval: float, next_flush: float, status: dict) -> tuple[float, float, bool]:
        """Evaluate and drain events when due: (next eval time, next drain time, whether the eval target stops the
        run). A call that fails because the outer optimizer is restarting (a kill between the loop's status call
        and these) leaves what it was doing due, to be done at the next tick, instead of failing the run."""
        try:
            if now >= next_eval:
                self._evaluate(t0)
                next_eval = now + self.cfg.eval.interval_s
                if self.evals.target_reached(self.cfg.run.stop_at_eval_loss):
                    log.warning("stopping on stop_at_eval_loss=%s before the token budget", self.cfg.run.stop_at_eval_loss)
                    self.stopped_by = "stop_at_eval_loss"
                    return next_eval, next_flush, True
            if now >= next_flush:
                new_rounds = self._drain_events()
                self.events.flush()
                next_flush = now + 5.0
                so_far = self.metrics.record_goodput_so_far(self._accounting, ledger=self.ledger.current,
                                                            snapshot=self.snapshot, run_start=self.run_start,
                                                            useful_before=self.ledger.useful_before) or {}
                if self.callbacks:  # the numbers the metrics just got
                    self.callbacks.round(ledger=self.ledger.current, status=status, statuses=island_statuses(self.snapshot)[0],
                                         new_rounds=new_rounds, wall_s=now - t0, goodput=so_far.get("goodput"),
                                         uptime=so_far.get("uptime"))
        except _TRANSIENT as err:
            _warn_transient(err)
        return next_eval, next_flush, False

    # ------------------------------------------------------------------ finish

    def _finish(self, t0: float) -> dict:
        """Stop the islands, flush and stop the outer optimizer, record the outcome, write summary.json."""
        self.evals.score_start()  # a run stopped before any island stepped still has its starting point
        flush = self.cfg.run.final_flush
        stop_began = time.time()  # uptime's clock ends here: from now on versions are held on purpose
        if flush:  # no round closes between the islands' last cuts and the final merge
            self._get(call(self.outer, _OuterShell.hold))
        t_stop = time.monotonic()
        self.snapshot = self._get(call(self.monitor, HealthMonitor.stop, flush=flush), timeout=self.cfg.run.call_timeout_s + 30)
        log.info("islands stopped in %.1fs", time.monotonic() - t_stop)
        run_end, wall = time.time(), time.monotonic() - t0
        if flush:
            self._final_flush(t_stop)
        self._get(call(self.outer, _OuterShell.stop), timeout=self.cfg.run.call_timeout_s + 30)
        record, new_rounds = self._record(t0, stop_began=stop_began, run_end=run_end, wall=wall)
        publish_outcome(record, new_rounds, metrics=self.metrics, callbacks=self.callbacks, events=self.events)
        summary = run_summary(record)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.callbacks.end(summary)
        return summary

    def _final_flush(self, t_stop: float) -> None:
        """Merge the stopped islands' last progress (run.final_flush), scoring the model before it first."""
        # The global model as the last regular round left it, scored on the same held-out batches: what
        # the final flush changes shows in the summary without another run's noise (RESULTS.md: a lead).
        self.evals.before_flush_loss = self.evals.loss(self._get(call(self.outer, _OuterShell.served_parameters)))
        closed = self._get(call(self.outer, _OuterShell.finish, self.cfg.run.call_timeout_s), timeout=self.cfg.run.call_timeout_s + 30)
        log.info("final flush: %d rounds closed with the islands' last progress (%.1fs after stop began)",
                 closed, time.monotonic() - t_stop)
        self.snapshot = self._get(call(self.monitor, HealthMonitor.refresh_statuses), timeout=self.cfg.run.call_timeout_s + 30)

    def _record(self, t0: float, *, stop_began: float, run_end: float, wall: float) -> tuple[SessionRecord, int]:
        """Gather the stopped session's outcome from the stopped actors: its record and the rounds drained last.
        Checkpoints the final model and ledger on the way, and evaluates the final model."""
        acct = self._accounting()
        status = self._get(call(self.outer, _OuterShell.status))  # stopped: its ledger is final
        fates = self.ledger.account(status, self.snapshot)
        live, dead = island_statuses(self.snapshot)
        # The last checkpoint holds the final model (orchestrator.run.trained reads it) and the final ledger.
        self._get(call(self.outer, _OuterShell.note, **self.ledger.note()))
        self._get(call(self.outer, _OuterShell.checkpoint))
        faults = self._get(call(self.injector, ChaosInjector.report)) if self.injector is not None else []
        new_rounds = self._drain_events()
        final_eval = self._evaluate(t0)
        if self.cfg.run.average_window is not None:  # the raw global model on the same batches: what averaging gave
            self.evals.raw_loss = self.evals.loss(self._get(call(self.outer, _OuterShell.global_parameters)))
        self._report(t0, status)
        good = self.ledger.goodput(acct, fates=fates, timeline=self.snapshot["timeline"], run_start=self.run_start,
                                   run_end=run_end, islands=self.cfg.num_islands, stop_began=stop_began)
        return SessionRecord(
            cfg=self.cfg, snapshot=self.snapshot, first_inc=self.ledger.first_inc, live=live, dead=dead, fates=fates,
            counted=self.ledger.counted(status, live, dead), good=good, status=status, final_eval=final_eval,
            wall=wall, faults=faults, eval_points=self.evals.points, before=self.ledger.before,
            before_flush_loss=self.evals.before_flush_loss, raw_loss=self.evals.raw_loss,
            unigram_bpb=self.evals.unigram_bpb, faults_planned=len(self.world.tape), network=self.world.network.describe(),
            network_emulated=self.world.network.emulated, stopped_by=self.stopped_by, run_start=self.run_start,
            resumed=self.resume, corpus=self.world.data.source,
        ), new_rounds

    def teardown(self) -> None:
        """Kill the run's actors and placement groups (islands are detached: they would outlive us)."""
        self.callbacks.fail(None)  # a run that never reached the end of _finish: its trackers' runs end, not hang open
        stop_session(self.run_id, self.monitor, self.injector, self.cfg.run.call_timeout_s)

def train(cfg: RunConfig, run_dir: str | Path, *, address: str | None = None,
          progress: Callable[[Progress], None] | None = None, resume: bool = False,
          stages: Callable[[Stage], None] | None = None, workload: Workload | None = None,
          prepared: Prepared | None = None, stop: StopRequest | None = None,
          on_ray: Callable[[], None] | None = None, callbacks: Sequence[Callback] | None = None) -> dict:
    """Run one training job: start or join Ray, train to the token budget, write RUN_DIR, return the summary.

    `workload` carries the public API's Python objects (model factory, loss, optimizer, datasets) that
    take the place of the config's import paths and data source (orchestrator/run/workload.py).
    `prepared`: what `prepare(cfg, workload, run_dir)` returned for these same arguments, when the caller
    checked it already (`diloco train` does, before it imports Ray); else it is prepared here.

    `progress` gets a `Progress` at every tick of the run; `stages` gets each start-up `Stage` as it happens
    (orchestrator/run/startup.py): Ray, placing, islands ready n of M, the first step. `callbacks`
    (orchestrator/run/callbacks.py) are called as the run goes, and so are the trackers `cfg.run.trackers` names.

    Bad input is refused before Ray starts (orchestrator.run.preflight: ConfigError, nothing written).
    RUN_DIR is created only once Ray is up and can host the run. A fresh run that fails before its
    islands train leaves no RUN_DIR that it created: RunNotStarted (ConfigError for a config problem)
    names the cause and where its driver.log was kept.

    Stopping early (orchestrator/run/stopping.py): `stop.ask(reason)` from a signal handler or another thread
    stops the run cleanly at its next tick, as the token budget does, and so does a KeyboardInterrupt while it
    trains; a run stopped by an interrupt then raises RunInterrupted (a KeyboardInterrupt carrying the summary)
    once its actors are gone. A KeyboardInterrupt while it starts abandons the start-up. `on_ray` is called once
    Ray is up in this process: `ray.init` installs its own SIGTERM handler, and a caller that owns the process's
    signals (`diloco train`) puts its own back there.
    """
    run_dir = Path(run_dir)
    check_callbacks(callbacks)
    preflight(cfg, run_dir, resume=resume)
    if prepared is None:
        prepared = prepare(cfg, workload, run_dir)  # the model built and the data checked, still before Ray starts
    cfg = with_measured_step(recorded_config(cfg, workload), address, prepared)
    if stages is not None:
        stages(Stage("ray", _ray_text(cfg, address)))
    started = ensure_ray(cfg, address)
    if on_ray is not None:
        on_ray()
    if started and not address:  # a Ray of our own never grows: what it cannot host now, it never will
        check_local_fit(cfg)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    ignore_zero_copy_warnings()
    run: Run | None = None
    stop = stop or StopRequest()
    try:
        run = Run(cfg, run_dir, progress=progress, resume=resume, stages=stages, workload=workload, prepared=prepared,
                  stop=stop, callbacks=callbacks)
        prepared = None  # the run owns it now
        if not started:  # joined a Ray that outlives this process: an exit without a clean stop kills the actors first
            stop.hard_stop = partial(kill_run_actors, run.run_id)
        summary = run.train()
    except BaseException as err:
        if run is not None:  # before teardown: the trackers' runs end as failed (or interrupted), with the cause
            run.callbacks.fail(err)
        _end_session(run, handler, started)
        if not created or resume or (run is not None and run.training_began):
            raise
        kept = _discard_run_dir(run_dir)
        if not isinstance(err, Exception):  # Ctrl-C: nothing to explain
            raise
        kind, cause = ((ConfigError, "") if isinstance(err, ConfigError) else (RunNotStarted, f"{type(err).__name__}: "))
        raise kind(f"{cause}{_first_line(err)} (nothing trained, so {run_dir} was removed; its driver.log is "
                   f"{kept})") from err
    _end_session(run, handler, started)
    if not started:  # a Ray that outlives us serves the run's metrics: let the final ones reach its export port
        run.metrics.wait_exported()
    if summary["stopped_by"] == INTERRUPTED:
        raise RunInterrupted(run_dir, summary)
    return summary


def _end_session(run: Run | None, handler: logging.Handler, started: bool) -> None:
    """Kill the run's actors, close driver.log, and shut down a Ray this driver started."""
    try:
        if run is not None:
            run.teardown()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        if started:
            ray.shutdown()


def _discard_run_dir(run_dir: Path) -> str:
    """Remove a run directory whose run never trained (a config and checkpoint 0 without progress would
    look like a run), keeping its driver.log in the temp directory; returns where it went, in words."""
    kept = Path(tempfile.gettempdir()) / f"diloco-{run_dir.name}-driver.log"
    try:
        shutil.move(run_dir / "driver.log", kept)
        where = str(kept)
    except OSError as err:
        where = f"lost ({err})"
    shutil.rmtree(run_dir, ignore_errors=True)
    return where


def _ray_text(cfg: RunConfig, address: str | None) -> str:
    """What the "ray" stage says: joining a cluster, using this process's Ray, or starting a local one."""
    if ray.is_initialized():
        return "using the Ray this process already runs"
    if address:
        return f"joining Ray at {address}"
    return "starting a local Ray"
