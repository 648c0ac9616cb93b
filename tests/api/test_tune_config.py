"""orchestrator.tune without Ray running: a trial's config as overrides, the docs' search space, the stop hand-over."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.config import ConfigError, RunConfig
from orchestrator.run.callbacks import RunInfo
from orchestrator.tune import TUNE_STOPPED, TuneReportCallback, _TrialStop, trial_config
from tests.integration.test_tune import base_config, doc_example


def test_a_trial_config_is_dotted_or_nested_overrides_checked_as_set_is():
    base = RunConfig()
    cfg = trial_config(base, {"outer.lr": np.float64(0.35), "outer": {"sync_every_steps": np.int64(20)},
                              "outer.min_quorum": "all", "pools.slow.islands": 3, "outer.grace_cap_s": float("inf")})
    assert (cfg.outer.lr, cfg.outer.sync_every_steps, cfg.outer.min_quorum) == (0.35, 20, "all")
    assert [p.islands for p in cfg.pools if p.name == "slow"] == [3] and cfg.outer.grace_cap_s == float("inf")
    assert trial_config(base, {}) is base
    with pytest.raises(ConfigError, match="did you mean 'outer.min_quorum'") as err:
        trial_config(base, {"outer.min_quorm": 2})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="outer.sync_every_steps"):
        trial_config(base, {"outer.sync_every_steps": "often"})


def test_the_docs_search_space_samples_valid_configs():
    example = doc_example()
    assert set(example.PARAM_SPACE) == {"outer.lr", "outer.sync_every_steps", "outer.min_quorum"}
    base = base_config()
    for _ in range(5):
        sample = {k: v.sample() for k, v in example.PARAM_SPACE.items()}
        cfg = trial_config(base, sample)
        assert (cfg.outer.lr, cfg.outer.sync_every_steps, cfg.outer.min_quorum) == tuple(sample.values())


def test_a_stop_asked_before_the_run_started_reaches_it_at_its_start():
    asked: list[str] = []
    stop = _TrialStop()
    stop.ask(TUNE_STOPPED)
    stop.attach(asked.append)
    stop.ask("again")  # the first reason is kept; the run hears every ask (its StopRequest keeps its first)
    assert stop.reason == TUNE_STOPPED and asked == [TUNE_STOPPED, "again"]


def test_outside_a_tune_trial_the_report_callback_does_nothing():
    cb = TuneReportCallback()
    info = RunInfo(run_dir=__import__("pathlib").Path("/tmp/x"), run_id="x-1", config=RunConfig(), resumed=False,
                   request_stop=lambda reason: pytest.fail("no stop outside Tune"))
    cb.on_start(info)
    cb.on_round(info, {"train_loss": 2.0, "goodput": 1.0, "tokens": 5})
    cb.on_eval(info, {"tokens": 5, "eval_loss": 3.0})
    assert not cb.stopped
