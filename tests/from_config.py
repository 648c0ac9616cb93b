"""Runtime settings for tests, built the way a run builds them: from a RunConfig (orchestrator.settings).

The engine's settings classes (OuterSettings, InnerSettings, IslandSpec) have no defaults of their own:
the config declares every setting once. A test takes the config's defaults (or a config dict of its
own) through the same builders the driver uses, and names what it changes as keyword overrides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from islands.spec import InnerSettings, IslandSpec, ModelConfig
from orchestrator.config import build_config
from orchestrator.core.settings import OuterSettings
from orchestrator.settings import inner_settings, island_specs, model_recipe, outer_settings
from policies.fragments import FragmentPlan


def outer_from_config(config: dict[str, Any] | None = None, **overrides: Any) -> OuterSettings:
    """The outer optimizer's settings of `config` (default: the built-in config), `overrides` replaced."""
    return replace(outer_settings(build_config(config or {})), **overrides)


def inner_from_config(config: dict[str, Any] | None = None, **overrides: Any) -> InnerSettings:
    """An island's inner settings of `config` (no pool: no emulation), `overrides` replaced."""
    return replace(inner_settings(build_config(config or {})), **overrides)


def spec_from_config(config: dict[str, Any] | None = None, *, model_config: ModelConfig | None, plan: FragmentPlan | None,
                     **overrides: Any) -> IslandSpec:
    """The first island slot's spec of `config` for the built-in model of shape `model_config` (None: the config's)
    and `plan`, `overrides` replaced (the
    slot, incarnation, pool and data shards included). No run id: the spec names no progress keeper."""
    cfg = build_config(config or {})
    recipe = model_recipe(cfg, shape=model_config)
    return replace(island_specs(cfg, recipe, plan)[0], **overrides)
