"""decoupled-diloco's Ray edge and its public API.

The public API, importable from here: :class:`DilocoTrainer` (orchestrator/api.py) with its
:class:`Result`, :class:`RunConfig` and :func:`load_config` (orchestrator/config.py). Everything else
(actors, the driver, checkpoints, events, reports, the CLI) lives in the subpackages. The API names
are loaded on first use, so importing the config (the CLI's first step) does not import Ray or torch.
"""

import os as _os

# Ray Train's PlacementGroupCleaner (data-parallel baseline) asks Ray's state API every second whether
# the trainer's controller lives. A local Ray started without the dashboard (ensure_ray) has no state
# API, so every ask logs "Failed to query Ray Train Controller actor state", about 2,000 lines over a
# half-hour baseline run, while the cleaner cannot act there anyway (the trainer removes its placement
# group itself when it ends). The driver prints worker logs through Ray's log deduplicator, which drops
# lines matching RAY_DEDUP_LOGS_SKIP_REGEX; Ray reads it when first imported, so the entry points import
# this package before `ray`. A value already set is kept.
RAY_LOG_SKIP = "Failed to query Ray Train Controller actor state"
_os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", RAY_LOG_SKIP)


__all__ = ["DilocoTrainer", "Result", "RunConfig", "load_config", "Progress", "ProgressPrinter"]


def __getattr__(name: str):  # PEP 562: the public names, imported on first use
    if name in ("DilocoTrainer", "Result"):
        from orchestrator import api

        return getattr(api, name)
    if name in ("RunConfig", "load_config"):
        from orchestrator import config

        return getattr(config, name)
    if name == "Progress":
        from orchestrator.run import driver

        return driver.Progress
    if name == "ProgressPrinter":
        from orchestrator.run import progress

        return progress.ProgressPrinter
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
