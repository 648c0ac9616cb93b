"""The public Python API, in Ray Train's shape: a trainer built from a model factory, datasets and a run config.

    from orchestrator import DilocoTrainer, RunConfig

    trainer = DilocoTrainer(
        model=make_model,                               # zero-argument function -> torch.nn.Module
        datasets={"train": train_ds, "validation": val_ds},
        loss_fn=None,                                   # default: outputs.loss or cross-entropy of the logits
        optimizer=None,                                 # default: AdamW with run_config.inner
        outer_optimizer=None,                           # default: Nesterov SGD with run_config.outer
        run_config=RunConfig(),
        run_dir="runs/mine",
    )
    result = trainer.fit()
    result.metrics["eval_loss"], result.path, result.checkpoint

It runs from a notebook against a local ``ray.init()``, from a script, and inside a Ray Job. Factories
reach the island processes as callables (Ray pickles them; one defined in a notebook travels by value)
or as import paths ``"package.module:function"``, which a resumed run or a Ray Job resolves on its own.
The contract a model meets is in docs/models.md; every argument is documented in docs/api.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from orchestrator.run.callbacks import Callback

__all__ = ["DilocoTrainer", "Result", "init_ray"]

_TRAIN_KEYS = ("train",)
_HELDOUT_KEYS = ("validation", "valid", "eval", "heldout", "test")


@dataclass(frozen=True)
class Result:
    """What :meth:`DilocoTrainer.fit` returns (Ray Train's ``Result`` shape).

    ``metrics``: the run's summary (summary.json): final held-out loss, tokens, goodput, rounds, ...
    ``path``: the run directory. ``checkpoint``: the directory of the final checkpoint (global state
    tensors plus a manifest; islands.model_api names the tensors), None if the run saved none.
    """

    metrics: dict[str, Any]
    path: Path
    checkpoint: Path | None
    error: BaseException | None = field(default=None)
    factory: Any = field(default=None, repr=False, compare=False)
    """The model factory `fit()` was given (a callable or an import path); None: the one config.yaml records."""

    def load_model(self, *, raw: bool = False, model: Callable[[], Any] | str | None = None) -> Any:
        """The trained model, rebuilt on the CPU in eval mode (orchestrator.run.trained.load_trained).

        Built by `model` (a zero-argument factory or its import path) if given, else by the factory `fit()` was
        given, else by the one the run directory records; `raw=True` skips the served moving average."""
        from orchestrator.run.trained import load_trained

        return load_trained(self.path, raw=raw, model=model if model is not None else self.factory).model


class DilocoTrainer:
    """Decoupled DiLoCo training of any ``torch.nn.Module`` on Ray: islands, the outer optimizer, self-healing.

    Args:
        model: a zero-argument function returning the ``torch.nn.Module`` to train (a callable, or an import
            path ``"package.module:function"``). The engine calls it under the run's seed in every process, so
            every island starts from the same weights. None: ``run_config.model.factory``, else the built-in
            byte transformer of ``run_config.model.preset``.
        datasets: ``{"train": ..., "validation": ...}`` (Ray Train's keys; "validation" is optional): each a
            map-style dataset (a ``torch.utils.data.Dataset`` or anything with ``__len__`` and
            ``__getitem__``; examples are collated with ``default_collate``), a ``ray.data.Dataset`` (materialized
            once; each island reads only its shard's blocks) or a 1-D array of token ids (windows of
            ``run_config.model.seq_len`` tokens). Without "validation", ``data.heldout_fraction`` of the
            examples is held out. None: the corpus ``run_config.data`` names.
        loss_fn: ``loss(model, batch) -> scalar tensor``. None: ``model(**batch).loss`` for a dict batch with
            "labels" (Hugging Face), else cross-entropy of the logits of ``model(inputs)`` against ``targets``
            for an ``(inputs, targets)`` batch.
        optimizer: ``optimizer(parameters) -> torch.optim.Optimizer``, the inner optimizer. None: AdamW with
            ``run_config.inner``. Its groups' learning rates are peaks the ``inner.lr_schedule`` scales.
        outer_optimizer: ``outer_optimizer(params) -> torch.optim.Optimizer`` over one fragment's global parameters,
            the outer step (a callable, or an import path; docs/outer.md, "Your own outer optimizer"). It is stepped
            with the merged outer gradient (global minus local parameters) as ``.grad``; a round that merges a share
            s < 1 of the islands steps with every group's lr times s. None: ``run_config.outer.optimizer``, else
            the built-in Nesterov SGD of ``run_config.outer``.
        run_config: the run's settings (orchestrator.config.RunConfig; docs/config.md). Default: ``RunConfig()``.
        run_dir: where the run writes its config, checkpoints, events and summary. Default: ``runs/<timestamp>``.
        address: a Ray cluster to join; None uses the Ray this process is connected to, or starts a local one.
        progress: True (default): print the start-up stages and a progress line every 10 s to stderr
            (orchestrator.ProgressPrinter); False or None: nothing; a callable: called with a ``Progress`` at
            every tick of the run (tokens, versions, losses), in place of the printer.
        resume: continue the run in ``run_dir`` from its newest checkpoint (pass the same model and datasets).
        callbacks: ``orchestrator.run.callbacks.Callback`` instances (Ray Train's ``RunConfig(callbacks=...)``),
            each hook called in the driver's thread at the start, after each evaluation, every ~5 s with the
            rounds merged, at island failures and restarts, and at the end; the built-in trackers
            (``orchestrator.run.trackers``: ``MLflowCallback``, ``TensorBoardCallback``, ``WandbCallback``) are
            callbacks. An exception in a hook is logged and the run goes on. The trackers
            ``run_config.run.trackers`` names run after these.
    """

    def __init__(self, model: Callable[[], Any] | str | None = None, *, datasets: Mapping[str, Any] | None = None,
                 loss_fn: Callable[..., Any] | str | None = None, optimizer: Callable[..., Any] | str | None = None,
                 run_config: RunConfig | None = None, run_dir: str | Path | None = None, address: str | None = None,
                 progress: Callable[[Any], None] | bool | None = True, resume: bool = False,
                 callbacks: Sequence[Callback] | None = None,
                 outer_optimizer: Callable[..., Any] | str | None = None) -> None:
        from orchestrator.run.workload import Workload

        if run_config is not None and not isinstance(run_config, RunConfig):
            raise ConfigError(f"run_config is a {type(run_config).__name__}; pass an orchestrator.RunConfig "
                              "(e.g. load_config('configs/default.yaml') or RunConfig())")
        train, heldout = _split_datasets(datasets)
        self.run_config = run_config or RunConfig()
        self.workload = Workload(model=model, loss=loss_fn, optimizer=optimizer, train=train, heldout=heldout,
                                 outer_optimizer=outer_optimizer)
        self.run_dir = Path(run_dir) if run_dir is not None else _default_run_dir()
        self.address, self.progress, self.resume = address, progress, resume
        from orchestrator.run.callbacks import check_callbacks

        check_callbacks(callbacks)  # before Ray: a class passed uncalled, say, is a one-line ConfigError
        self.callbacks = list(callbacks or ())

    def fit(self) -> Result:
        """Train to the run's token budget (or stop rule) and return the :class:`Result`.

        Bad input (an import path that does not resolve, a factory that returns no module, a loss that is
        not a scalar, an empty or too small dataset, token ids past the model's vocabulary) raises
        ConfigError in one line before Ray starts, and no run directory is left behind.
        """
        from orchestrator.core.checkpoint import CheckpointStore, checkpoint_dirname, run_checkpoint_uri
        from orchestrator.run.driver import train
        from orchestrator.run.progress import ProgressPrinter
        from orchestrator.run.results import emulation_note

        progress, stages = self.progress, None
        if progress is True:  # the default: what `diloco train` shows, as plain lines
            printer = ProgressPrinter(emulation=emulation_note(self.run_config))
            progress, stages = printer, printer.stage
        summary = train(self.run_config, self.run_dir, address=self.address, progress=progress or None,
                        resume=self.resume, stages=stages, workload=self.workload, callbacks=self.callbacks)
        uri = run_checkpoint_uri(self.run_config.checkpoint.uri, self.run_dir)
        steps = CheckpointStore(uri).list() if "://" not in uri else []
        checkpoint = Path(uri) / checkpoint_dirname(steps[-1]) if steps else None
        return Result(metrics=summary, path=self.run_dir.resolve(), checkpoint=checkpoint, factory=self.workload.model)


def init_ray(run_config: RunConfig | None = None, *, address: str | None = None, ray_data_v2: bool = False) -> bool:
    """Start or join Ray for a run of `run_config` now, as `fit()` would, for work before `fit()` (a Ray Data pipeline).

    Joins `address` (a cluster: "auto", "HOST:PORT"), else starts a local Ray with at least the logical CPUs the
    run's islands and spares reserve; nothing when this process is connected already. Then sets this process
    up as the driver of a run: Ray's zero-copy notices silenced (fetched tensors are never written in place),
    and Ray Data's classic Parquet reader (``DataContext.use_datasource_v2 = False``) unless `ray_data_v2`:
    Ray 2.60's DataSource V2 starts footer-reading actors for every ``read_parquet``, about 7 s for one small file
    on 2 cores against 0.2 s. Returns True when this call started or joined Ray. ``fit()`` then uses that Ray
    and leaves it running; ``ray.shutdown()`` ends it.
    """
    import ray.data

    from orchestrator.actors.runtime import ignore_zero_copy_warnings
    from orchestrator.run.driver import ensure_ray

    if run_config is not None and not isinstance(run_config, RunConfig):
        raise ConfigError(f"run_config is a {type(run_config).__name__}; pass an orchestrator.RunConfig")
    started = ensure_ray(run_config or RunConfig(), address)
    ignore_zero_copy_warnings()
    if not ray_data_v2:
        ray.data.DataContext.get_current().use_datasource_v2 = False
    return started


def _split_datasets(datasets: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """(train, held-out) from Ray Train style ``datasets``; a one-line ConfigError for unknown keys."""
    if datasets is None:
        return None, None
    if not isinstance(datasets, Mapping):
        raise ConfigError(f"datasets is a {type(datasets).__name__}; pass a dict such as "
                          "{'train': train_ds, 'validation': val_ds}")
    unknown = sorted(set(datasets) - set(_TRAIN_KEYS) - set(_HELDOUT_KEYS))
    if unknown or "train" not in datasets:
        raise ConfigError(f"datasets has keys {sorted(datasets)}; it needs 'train' and may have one of "
                          f"{', '.join(repr(k) for k in _HELDOUT_KEYS)} for evaluation")
    heldout = [datasets[k] for k in _HELDOUT_KEYS if k in datasets]
    if len(heldout) > 1:
        raise ConfigError("datasets has more than one held-out split; pass one of them as 'validation'")
    return datasets["train"], heldout[0] if heldout else None


def _default_run_dir() -> Path:
    import time

    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")
