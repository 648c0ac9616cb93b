"""Imports inside islands/ point one way: the worker group knows no trainer, the trainer no island."""

import subprocess
import sys


def _loaded_after(module: str) -> set[str]:
    """The islands.* modules a fresh interpreter has loaded after importing `module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('islands.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_worker_group_imports_no_trainer_follower_or_island():
    loaded = _loaded_after("islands.distributed")
    assert not loaded & {"islands.trainer", "islands.follower", "islands.island"}, loaded


def test_the_island_collaborators_do_not_import_the_island():
    for module in ("islands.outbox", "islands.inbox", "islands.salvage_shelf", "islands.follower"):
        assert "islands.island" not in _loaded_after(module), module
