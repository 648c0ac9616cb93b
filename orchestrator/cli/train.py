"""`diloco train`: one training run with Decoupled DiLoCo on Ray, with a progress line and the final table."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from orchestrator.cli.model import import_from_cwd
from orchestrator.config import ConfigError, RunConfig, apply_overrides, build_config, load_config, resume_conflict
from orchestrator.run.progress import progress_fields, stage_line
from orchestrator.run.startup import Stage
from orchestrator.run.summary import format_summary

if TYPE_CHECKING:
    from orchestrator.cli.interrupts import SignalStop


class ProgressBar:
    """One status line on a terminal (redrawn in place), or a line every 10 s when not a terminal."""

    def __init__(self, stream: TextIO, *, emulation: str | None, started: float | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last = 0.0
        self._started = time.monotonic() if started is None else started  # start-up lines count from here
        if emulation:
            stream.write(f"{emulation}\n")
            stream.flush()

    def stage(self, s: Stage) -> None:
        """One line per start-up stage as it happens, e.g. `start-up   3.1s  islands ready 2 of 4`."""
        self.stream.write(stage_line(time.monotonic() - self._started, s) + "\n")
        self.stream.flush()

    def __call__(self, p) -> None:  # p: orchestrator.run.driver.Progress
        now = time.monotonic()
        if not self.tty and now - self._last < 10.0 and p.tokens < p.budget:
            return
        self._last = now
        frac, middle, islands = progress_fields(p)  # the same fields as fit()'s lines (orchestrator/run/progress.py)
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        line = (f"[{bar}] {frac:4.0%} {p.tokens / 1e6:6.2f}M/{p.budget / 1e6:.2f}M tokens | {middle}"
                f" | {p.elapsed_s:5.0f}s | islands {islands}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line."""
        if self.tty:
            self.stream.write("\n")


LATEST = "latest"
"""Name of the link beside a run directory that points at the newest run (runs/latest for the default runs/<timestamp>)."""

log = logging.getLogger(__name__)


def link_latest(run_dir: Path) -> Path | None:
    """Point `latest` beside `run_dir` at it; return the link, or None (with a warning) where none can be made.

    The link is relative (the runs folder can move) and replaces an older link atomically (a new link
    under a temporary name, renamed over it), so a reader never finds it missing. A real file or
    directory named `latest` is left alone.
    """
    run_dir = Path(run_dir)
    link = run_dir.parent / LATEST
    if run_dir.name == LATEST:
        return None
    if link.exists() and not link.is_symlink():
        log.warning("%s is not a link; left alone, so it does not point at %s", link, run_dir)
        return None
    tmp = run_dir.parent / f".{LATEST}.tmp-{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except (OSError, NotImplementedError) as err:  # no symlinks here (some Windows setups, some filesystems)
        tmp.unlink(missing_ok=True)
        log.warning("could not link %s to %s (%s); use the run directory printed at the end", link, run_dir, err)
        return None
    return link


class _LinkLatestOnStart:
    """The progress callback, which also links `latest` at the run once training has started writing it."""

    def __init__(self, run_dir: Path, bar: ProgressBar | None) -> None:
        self.run_dir, self.bar, self.linked = run_dir, bar, False

    def __call__(self, p) -> None:
        if not self.linked:
            self.linked = True
            link_latest(self.run_dir)
        if self.bar:
            self.bar(p)


MODEL_FLAGS = {"model": "factory", "loss": "loss", "optimizer": "optimizer"}
"""`diloco train --model/--loss/--optimizer` -> the model section's field each one sets."""


def with_model_flags(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """`cfg` with model.factory, model.loss and model.optimizer set from --model, --loss and --optimizer.

    The same as `--set model.factory=...` (applied after every --set), except that the value is taken as
    it is rather than parsed as YAML: an import path is a string whatever it looks like. Resolving it is
    left to the run's prepare step (orchestrator/run/workload.py), which says in one line what is wrong.
    """
    update = {field: getattr(args, flag) for flag, field in MODEL_FLAGS.items() if getattr(args, flag, None) is not None}
    if not update:
        return cfg
    data = cfg.model_dump(mode="json")
    data["model"].update(update)
    return build_config(data, recorded=True)  # `cfg` was checked, and the model's import paths have no rules to break


def with_tracker_flags(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """`cfg` with each `--tracker` appended to run.trackers (docs/trackers.md): `mlflow[:URI]`, `tensorboard[:DIR]`,
    `wandb[:PROJECT]`. Raises ConfigError (one line) for an entry that is none of these."""
    from orchestrator.config import tracker_spec

    extra = list(getattr(args, "tracker", None) or [])
    for entry in extra:
        try:
            tracker_spec(entry)
        except ValueError as err:
            raise ConfigError(f"--tracker: {err}") from None
    if not extra:
        return cfg
    data = cfg.model_dump(mode="json")
    data["run"]["trackers"] = [*cfg.run.trackers, *(t for t in dict.fromkeys(extra) if t not in cfg.run.trackers)]
    return build_config(data, recorded=True)  # `cfg` was checked; the entries were just now


def _cmd_train(args: argparse.Namespace) -> int:
    # SIGINT and SIGTERM from the start: the first stops the run cleanly (or abandons its start-up), a second
    # exits at once (orchestrator/cli/interrupts.py); no traceback either way.
    from orchestrator.cli.interrupts import SignalStop
    from orchestrator.run.stopping import StopRequest

    signals = SignalStop(StopRequest())
    signals.install()
    try:
        return _train(args, signals)
    except KeyboardInterrupt:  # before the run could start (loading torch, checking the model and data)
        print(f"diloco train: {_interrupted_before(signals.run_dir, None)}", file=sys.stderr)
        return signals.exit_code


def _interrupted_before(run_dir: Path | None, cfg: RunConfig | None) -> str:
    """What an interrupt before the run trained leaves, in words: the resume command where RUN_DIR holds a
    checkpoint to resume from (a resume's, or a start-up interrupted after training began), else that there is none."""
    from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
    from orchestrator.run.stopping import resume_command

    if run_dir is not None and cfg is not None and (run_dir / "config.yaml").is_file():
        uri = run_checkpoint_uri(cfg.checkpoint.uri, run_dir)
        if "://" in uri or CheckpointStore(uri).list():
            return f"interrupted while starting; resume with: {resume_command(run_dir)}"
    return "interrupted while starting, before every island trained; nothing to resume"


def _train(args: argparse.Namespace, signals: SignalStop) -> int:
    """`diloco train` itself; `signals` (orchestrator.cli.interrupts.SignalStop) handles SIGINT and SIGTERM.

    In order, each step before the next imports more: the config checked (no torch, no Ray), the model built and
    the data checked (torch), then the run (Ray)."""
    started = time.monotonic()
    # Not the driver yet: it imports torch and Ray (seconds); bad input and the first lines come before that.
    from orchestrator.run.preflight import preflight  # no Ray, no torch: bad input fails fast
    from orchestrator.run.results import emulation_note

    try:
        cfg, run_dir = _train_config(args)
        signals.run_dir = run_dir
        preflight(cfg, run_dir, resume=bool(args.resume))  # before Ray starts and before RUN_DIR exists
    except (ConfigError, ValueError) as err:
        print(f"diloco train: {err}", file=sys.stderr)
        return 2
    bar = ProgressBar(sys.stderr, emulation=emulation_note(cfg), started=started) if not args.quiet else None
    if bar:
        bar.stage(Stage("load", "loading torch and Ray"))
    # The model built and the data checked with torch alone: a bad --model, --loss, --optimizer or dataset
    # is refused before Ray is even imported (seconds), and before RUN_DIR exists.
    from orchestrator.run.workload import prepare

    # A --model in a file beside the user resolves as it does under `python -m` and in the islands (a local
    # Ray puts the driver's working directory on its workers' path), and as sample/evaluate/export resolve it.
    import_from_cwd()
    try:
        prepared = prepare(cfg, run_dir=run_dir)  # a resume reads the tokenizer RUN_DIR saved, if any
    except ConfigError as err:
        if bar:
            bar.close()
        logging.getLogger(__name__).debug("bad model or data", exc_info=True)
        print(f"diloco train: {err}", file=sys.stderr)
        return 2
    from orchestrator.run.driver import train  # Ray: after the checks

    address = args.address or os.environ.get("RAY_ADDRESS")
    try:
        summary = train(cfg, run_dir, address=address, progress=_LinkLatestOnStart(run_dir, bar),
                        resume=bool(args.resume), stages=bar.stage if bar else None, prepared=prepared,
                        stop=signals.stop, on_ray=signals.reinstall_sigterm)
    except (KeyboardInterrupt, Exception) as err:  # noqa: BLE001 - one line for the user; the traceback is in driver.log
        if bar:
            bar.close()
        return _train_failed(err, run_dir, cfg, signals)
    if bar:
        bar.close()
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return 0


def _train_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The run's config and RUN_DIR from `diloco train`'s arguments: --config (or a resumed run's own config.yaml),
    then --chaos and every --set, then --model/--loss/--optimizer and --tracker. Raises ConfigError (one line)
    for a resume that changes what its checkpoints depend on, ValueError for a bad --chaos."""
    from orchestrator.run.preflight import resume_config
    from policies.chaos import parse_chaos_spec

    overrides = list(args.set)
    if args.chaos:  # the chaos section's mode and params, validated with the rest (a horizon fixed does not use, ...)
        spec = parse_chaos_spec(args.chaos)
        overrides += [f"chaos.mode={spec.pop('mode')}", f"chaos.params={json.dumps(spec)}"]
    if args.resume:
        if args.config:
            raise ConfigError("--resume takes the run directory's own config.yaml; drop --config")
        saved = resume_config(args.resume)
        cfg = with_model_flags(build_config(apply_overrides(saved.model_dump(mode="json"), overrides)), args)
        conflict = resume_conflict(saved, cfg)
        if conflict:
            raise ConfigError(conflict)
    else:
        cfg = with_model_flags(load_config(args.config, overrides), args)
    cfg = with_tracker_flags(cfg, args)
    return cfg, Path(args.resume or args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")


def _train_failed(err: BaseException, run_dir: Path, cfg: RunConfig, signals: SignalStop) -> int:
    """What `diloco train` says (one line) and exits with when the run did not finish: an interrupt's (the resume
    command where there is a checkpoint to resume from), 2 for bad input, else 1."""
    from orchestrator.run.driver import RayStartError, RunNotStarted
    from orchestrator.run.stopping import RunInterrupted, resume_command

    if isinstance(err, RunInterrupted):  # stopped cleanly: summary.json says "interrupted", the last checkpoint holds the rest
        print(f"diloco train: interrupted: stopped cleanly; resume with: {resume_command(run_dir)}", file=sys.stderr)
        return signals.exit_code
    if isinstance(err, KeyboardInterrupt):  # while the run started: train() abandoned it (and removed a fresh RUN_DIR)
        print(f"diloco train: {_interrupted_before(run_dir, cfg)}", file=sys.stderr)
        return signals.exit_code
    logging.getLogger(__name__).debug("train failed", exc_info=err)
    if isinstance(err, ConfigError):  # what only a started Ray could tell (check_local_fit): still bad input
        print(f"diloco train: {err}", file=sys.stderr)
        return 2
    if isinstance(err, (RayStartError, RunNotStarted)):  # their messages name the cause already
        print(f"diloco train: {err}", file=sys.stderr)
        return 1
    print(f"diloco train: {type(err).__name__}: {err}", file=sys.stderr)
    return 1


def register(subparsers) -> None:
    """Add `train` to the `diloco` parser's subparsers."""
    t = subparsers.add_parser("train", help="train a model with Decoupled DiLoCo on Ray",
                              description="Train on the embedded default (stdlib source) or your config.\n\nExamples:\n"
                                          "  diloco train --run-dir runs/demo --set run.token_budget=3000000\n"
                                          "  diloco train --model mypkg.models:build --loss mypkg.models:loss   # your own model\n\n"
                                          "Bad input (a --model that does not import, a loss that is not a scalar, data too\n"
                                          "small for the islands, ...) is refused in one line, exit code 2, before Ray starts\n"
                                          "and before RUN_DIR is created (docs/bad-input.md).",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", help="YAML run config (default: built-in defaults, same as configs/default.yaml)")
    t.add_argument("--run-dir", help="where to write the event log and summary (default: runs/<timestamp>); "
                                     "a link `latest` beside it points at it once training starts")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set outer.min_quorum=2 or one pool's: --set pools.slow.islands=3 (repeatable)")
    t.add_argument("--model", metavar="PACKAGE.MODULE:FUNCTION",
                   help="train your own torch.nn.Module: a function of no arguments that returns it, found by import "
                        "path (the current directory and PYTHONPATH are searched); same as --set model.factory=...; "
                        "default: the built-in byte transformer of model.preset")
    t.add_argument("--loss", metavar="PACKAGE.MODULE:FUNCTION",
                   help="loss(model, batch) -> scalar tensor; same as --set model.loss=...; default: cross-entropy of "
                        "the logits against the next tokens (or outputs.loss for a dict batch with labels)")
    t.add_argument("--optimizer", metavar="PACKAGE.MODULE:FUNCTION",
                   help="inner optimizer(parameters) -> torch.optim.Optimizer; same as --set model.optimizer=...; "
                        "default: AdamW with the inner section's settings")
    t.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run whose driver died, from its checkpoints")
    t.add_argument("--tracker", action="append", default=[], metavar="NAME[:WHERE]",
                   help="log the run to an experiment tracker: mlflow[:TRACKING_URI], tensorboard[:DIR] or "
                        "wandb[:PROJECT] (repeatable; appends to run.trackers; docs/trackers.md)")
    t.add_argument("--chaos", metavar="SPEC",
                   help="inject faults: none | tape:FILE.yaml | poisson:mtbf_s=60,seed=3 | fixed:failures=3")
    t.set_defaults(func=_cmd_train)
