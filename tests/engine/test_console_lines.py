"""What a user reads on the console carries no internal class names or escape codes, and one unit per line.

No Ray cluster: Ray's own printing function, the actors' log set-up and the CLI's console handler are run
directly. A worker line used to reach the driver as `ESC[36m(_OuterShell pid=4242)ESC[0m 2026-...
orchestrator.actors.outer WARNING island 0 incarnation 1 lost: ...`; Ray's token-authentication notice
landed between the start-up lines.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

ENV = {k: v for k, v in os.environ.items() if k not in ("RAY_DISABLE_WORKER_LOG_PREFIX", "RAY_COLOR_PREFIX")}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120, check=True)


def test_worker_lines_reach_the_driver_bare_once_the_package_is_imported_first():
    # As the entry points do: orchestrator, then ray. The line is what an actor's RoleFormatter wrote.
    done = _python(
        "import orchestrator, ray\n"
        "from ray._private import ray_constants\n"
        "from ray._private.worker import print_to_stdstream\n"
        "line = 'outer optimizer: island 0 incarnation 1 lost: killed'\n"
        "print_to_stdstream({'pid': 4242, 'actor_name': '_OuterShell', 'ip': '10.0.0.1', 'localhost': '10.0.0.1',\n"
        "                    'is_err': True, 'lines': [line]}, ignore_prefix=ray_constants.RAY_DISABLE_WORKER_LOG_PREFIX)\n"
        "print_to_stdstream({'pid': 'raylet', 'is_err': True, 'lines': ['a raylet notice']}, ignore_prefix=False)\n")
    assert done.stderr.splitlines() == ["outer optimizer: island 0 incarnation 1 lost: killed", "(raylet) a raylet notice"]
    assert "\x1b" not in done.stderr and "_OuterShell" not in done.stderr


def test_an_actors_lines_name_its_role_and_say_errors_and_nothing_internal():
    done = _python(
        "import logging\n"
        "from orchestrator.actors.runtime import quiet_worker\n"
        "quiet_worker('warm spare')\n"
        "logging.getLogger('orchestrator.actors.islands').info('not on the console')\n"
        "quiet_worker('island 3')  # the spare became island 3\n"
        "logging.getLogger('orchestrator.actors.islands').warning('inner loop %s', 'hung')\n"
        "logging.getLogger('orchestrator.actors.health_monitor').error('restart of island %d failed: %s', 3, 'no room')\n"
        "logging.getLogger('islands.outbox').warning('island %d: dropping submission %d', 3, 7)  # names itself\n")
    assert done.stderr.splitlines() == ["island 3: inner loop hung", "island 3: error: restart of island 3 failed: no room",
                                        "island 3: dropping submission 7"]


def test_the_cli_console_leaves_out_rays_token_notice_and_module_names():
    # A fresh interpreter: Ray's own logger, as `diloco` has it when ray.init starts a local Ray.
    done = _python(
        "import ray\n"
        "from ray._private.authentication import authentication_token_setup as auth\n"
        "from orchestrator.run.notices import quiet_ray_notices\n"
        "quiet_ray_notices()\n"
        "auth._warn_token_auth_enabled()  # ray.init starting a local Ray with RAY_AUTH_MODE unset\n"
        "auth._warn_token_auth_disabled()  # a security notice: kept\n")
    assert "Token authentication is enabled" not in done.stderr
    assert "Token authentication is disabled" in done.stderr
    from orchestrator.cli.main import _stderr_handler

    record = logging.LogRecord("orchestrator.run.driver", logging.WARNING, __file__, 1, "stopping on %s", ("max_wall_s",), None)
    assert _stderr_handler().format(record) == "diloco: stopping on max_wall_s"


def test_fit_starts_its_local_ray_with_rays_token_notice_left_out():
    # DilocoTrainer.fit() and init_ray start a local Ray through ensure_ray, not the CLI: the same filter must be on
    # Ray's logger by the time ray.init runs (the stand-in init below emits the notice as Ray's start does).
    done = _python(
        "from ray._private.authentication import authentication_token_setup as auth\n"
        "from orchestrator.config import RunConfig\n"
        "from orchestrator.run.driver import ensure_ray\n"
        "ensure_ray(RunConfig(), None, init=lambda **kw: auth._warn_token_auth_enabled())\n")
    assert done.returncode == 0, done.stderr
    assert "Token authentication is enabled" not in done.stderr, done.stderr
