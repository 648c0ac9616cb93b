"""The Ray edge of decoupled-diloco: actors, the driver, checkpoints, events, reports and the CLI."""

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
