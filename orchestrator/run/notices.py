"""Ray's start-up notices that a user of `diloco` or `fit()` should not read in the middle of the start-up lines.

Ray's notice that the local Ray it starts has token authentication on (RAY_AUTH_MODE unset) lands between the
start-up stages; docs/jobs.md says what token authentication means for other clients. Its warning that
authentication is *off* (a security notice) is kept. The CLI installs the filters at start, and the driver before
it starts a local Ray (orchestrator.run.driver.ensure_ray), so `DilocoTrainer.fit()` is quiet the same way.
"""

from __future__ import annotations

import logging

__all__ = ["RAY_NOTICES", "quiet_ray_notices"]

RAY_NOTICES = {"ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this Ray cluster"}


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_ray_notices() -> None:
    """Keep Ray's start-up notices listed in RAY_NOTICES off the console (filters on Ray's own loggers; idempotent)."""
    for name, prefix in RAY_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(prefix))
