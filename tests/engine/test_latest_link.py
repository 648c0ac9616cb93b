"""`diloco train` points `runs/latest` at its run directory, so the README's `diloco report runs/latest` works."""

from __future__ import annotations

import logging
import os

import pytest

from orchestrator.cli import train as train_cli
from orchestrator.cli.train import link_latest


def test_latest_is_a_relative_link_replaced_by_the_next_run(tmp_path):
    runs = tmp_path / "runs"
    first, second = runs / "20261127-100000", runs / "20261127-110000"
    first.mkdir(parents=True)
    second.mkdir()
    assert link_latest(first) == runs / "latest"
    assert os.readlink(runs / "latest") == "20261127-100000", "relative, so the runs folder can move"
    (first / "summary.json").write_text("{}")
    assert (runs / "latest" / "summary.json").is_file()
    assert link_latest(second) == runs / "latest"
    assert os.readlink(runs / "latest") == "20261127-110000"
    assert sorted(p.name for p in runs.iterdir()) == ["20261127-100000", "20261127-110000", "latest"], "no temp link left"


def test_a_real_latest_directory_is_left_alone(tmp_path, caplog):
    (tmp_path / "latest").mkdir()
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.WARNING):
        assert link_latest(tmp_path / "run") is None
    assert (tmp_path / "latest").is_dir() and not (tmp_path / "latest").is_symlink()
    assert "is not a link; left alone" in caplog.text
    assert link_latest(tmp_path / "latest") is None, "a run directory named latest is its own link"


def test_no_symlinks_is_a_warning_not_a_failure(tmp_path, caplog, monkeypatch):
    (tmp_path / "run").mkdir()

    def refuse(*args, **kwargs):
        raise OSError(1, "symbolic links are not supported")

    monkeypatch.setattr(train_cli.os, "symlink", refuse)
    with caplog.at_level(logging.WARNING):
        assert link_latest(tmp_path / "run") is None
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert "could not link" in caplog.text and "use the run directory printed at the end" in caplog.text


@pytest.mark.parametrize("with_bar", [True, False], ids=["progress-bar", "quiet"])
def test_the_link_is_made_at_the_first_progress_call(tmp_path, with_bar):
    run = tmp_path / "run"
    run.mkdir()
    seen = []
    callback = train_cli._LinkLatestOnStart(run, seen.append if with_bar else None)
    assert not (tmp_path / "latest").is_symlink()
    callback("p1")
    assert os.readlink(tmp_path / "latest") == "run"
    callback("p2")
    assert seen == (["p1", "p2"] if with_bar else [])
