"""policies.outer_regime: the outer step's settings from the run's shape, and how the config applies them."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.config import ConfigError, build_config, load_config
from policies.outer_regime import regime_outer_step

ONE_ISLAND = {"pools": [{"name": "solo", "islands": 1}]}


def test_one_island_takes_the_plain_step_and_more_islands_keep_the_defaults():
    step = regime_outer_step(islands=1)
    assert step is not None and (step.lr, step.momentum) == (1.0, 0.0) and "one island" in step.rule
    assert regime_outer_step(islands=2) is None and regime_outer_step(islands=64) is None
    with pytest.raises(ValueError, match="islands must be >= 1, got 0"):
        regime_outer_step(islands=0)


def test_the_config_fills_only_what_the_user_left_unset():
    cfg = build_config(ONE_ISLAND)
    assert (cfg.outer.lr, cfg.outer.momentum) == (1.0, 0.0)
    default = build_config({})  # four islands: the config's own defaults
    assert (default.outer.lr, default.outer.momentum) == (0.7, 0.9)
    # Field by field: a value the user gives wins, even one equal to the default.
    mixed = build_config({**ONE_ISLAND, "outer": {"lr": 0.7}})
    assert (mixed.outer.lr, mixed.outer.momentum) == (0.7, 0.0)
    both = build_config({**ONE_ISLAND, "outer": {"lr": 0.5, "momentum": 0.9}})
    assert (both.outer.lr, both.outer.momentum) == (0.5, 0.9)
    # An elastic pool counts its maximum: it may grow to two islands, so the defaults stand.
    elastic = build_config({"pools": [{"name": "e", "islands": {"min": 1, "max": 2}}]})
    assert (elastic.outer.lr, elastic.outer.momentum) == (0.7, 0.9)


def test_an_outer_optimizer_plug_in_is_left_alone():
    cfg = build_config({**ONE_ISLAND, "outer": {"optimizer": "tests.engine.test_outer_regime:adam"}})
    assert cfg.outer.optimizer and (cfg.outer.lr, cfg.outer.momentum) == (0.7, 0.9), "no lr beside a plug-in"
    with pytest.raises(ConfigError, match="outer.lr"):
        build_config({**ONE_ISLAND, "outer": {"optimizer": "tests.engine.test_outer_regime:adam", "lr": 1.0}})


def test_the_recorded_config_holds_the_values_the_run_used_and_reads_back_the_same(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(build_config(ONE_ISLAND).model_dump(mode="json")))
    again = load_config(str(path), [])
    assert (again.outer.lr, again.outer.momentum) == (1.0, 0.0)
    # Read back with a second pool, the recorded values are the user's now: they stay (no rule re-applied).
    grown = load_config(str(path), ["pools=[{name: a, islands: 1}, {name: b, islands: 1}]"])
    assert (grown.outer.lr, grown.outer.momentum) == (1.0, 0.0)


def adam(params):
    """An outer-optimizer factory for the plug-in case (torch.optim.Adam)."""
    import torch

    return torch.optim.Adam(params, lr=0.1)
