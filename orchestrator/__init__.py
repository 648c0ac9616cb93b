"""decoupled-diloco's Ray edge and its public API.

The public API, importable from here (docs/api.md):

- training: :class:`DilocoTrainer` and its :class:`Result` (orchestrator/api.py), :class:`RunConfig` and
  :func:`load_config` (orchestrator/config.py), :func:`init_ray` (Ray up before ``fit()``, for a Ray Data
  pipeline), :class:`Progress` (what a ``progress`` callable gets) and :class:`ProgressPrinter` (the default one);
- text: :func:`train_tokenizer` (a byte-level BPE trained locally), :func:`text_encoder` (a
  :class:`TextEncoder` from a tokenizer, a tokenizer.json or bytes) and :func:`sample_text` (a prompt
  continued by a trained causal LM through such an encoder; islands/tokenizer.py, islands/sampling.py).

Everything else (actors, the driver, checkpoints, events, reports, the CLI) lives in the subpackages. The API
names are loaded on first use, so importing the config (the CLI's first step) does not import Ray or torch.
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
# Worker lines on the driver's console: Ray leads each with `(ClassName pid=N)` in ANSI colour, internal class
# names (`(_OuterShell pid=4242)`) a user cannot place. Our actors name their role in the line itself
# (orchestrator/actors/runtime.py, RoleFormatter: "health monitor: island 0 incarnation 1 dead: ..."), so the
# driver prints worker lines bare (RAY_DISABLE_WORKER_LOG_PREFIX, read when Ray is first imported) and without
# colour (RAY_COLOR_PREFIX, read at each line). Values already set are kept.
_os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
_os.environ.setdefault("RAY_COLOR_PREFIX", "0")


__all__ = ["DilocoTrainer", "Result", "init_ray", "RunConfig", "load_config", "Progress", "ProgressPrinter",
           "TextEncoder", "text_encoder", "train_tokenizer", "sample_text"]


def __getattr__(name: str):  # PEP 562: the public names, imported on first use (by name: import walks see each edge)
    if name in ("DilocoTrainer", "Result", "init_ray"):
        from orchestrator import api as module
    elif name in ("RunConfig", "load_config"):
        from orchestrator import config as module
    elif name == "Progress":
        from orchestrator.run import driver as module
    elif name == "ProgressPrinter":
        from orchestrator.run import progress as module
    elif name in ("TextEncoder", "text_encoder", "train_tokenizer"):
        from islands import tokenizer as module
    elif name == "sample_text":
        from islands import sampling as module
    else:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
