"""Elastic pools in the config: `islands: {min: A, max: B}`, what it means, what it refuses and how --set treats it.

Pins PoolConfig's range spelling (B slots, A required; min == max is a fixed pool), the one-line errors that
name the pool and the fix, RunConfig's required_islands and elastic_slots (slots numbered over the pools in
config order), and the behaviour of `--set pools.NAME.islands=...` on an elastic pool.
"""

from __future__ import annotations

import pytest

from orchestrator.config import ConfigError, PoolConfig, apply_overrides, build_config, load_config

ELASTIC = {"name": "spot", "islands": {"min": 1, "max": 4}}


def pools(*entries: dict) -> dict:
    """A config dict of these pools, everything else the defaults."""
    return {"pools": list(entries)}


def pool(cfg, name: str) -> PoolConfig:
    return next(p for p in cfg.pools if p.name == name)


def refused(data: dict) -> str:
    """The one-line ConfigError `data` raises."""
    with pytest.raises(ConfigError) as err:
        build_config(data)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- the range spelling ------------------------------------------------------------------------


def test_range_is_max_slots_of_which_min_are_required():
    p = pool(build_config(pools(ELASTIC)), "spot")
    assert (p.islands, p.min_islands, p.elastic, p.required_islands) == (4, 1, True, 1)


def test_plain_int_is_a_fixed_pool():
    p = pool(build_config(pools({"name": "f", "islands": 3})), "f")
    assert (p.islands, p.min_islands, p.elastic, p.required_islands) == (3, None, False, 3)


def test_min_equal_max_is_not_elastic_and_requires_every_slot():
    p = pool(build_config(pools({"name": "f", "islands": {"min": 2, "max": 2}})), "f")
    assert (p.islands, p.min_islands, p.elastic, p.required_islands) == (2, 2, False, 2)
    assert p.spares, "a pool whose min is its max is fixed: it may hold warm spares"


def test_min_zero_pool_beside_a_fixed_one_is_allowed():
    cfg = build_config(pools({"name": "f", "islands": 1}, {"name": "spot", "islands": {"min": 0, "max": 3}}))
    assert cfg.num_islands == 4 and cfg.required_islands == 1


def test_matching_min_islands_is_accepted_beside_the_range():
    p = pool(build_config(pools({**ELASTIC, "min_islands": 1})), "spot")
    assert (p.islands, p.min_islands) == (4, 1)


@pytest.mark.parametrize("islands, fix", [
    ({"min": 3, "max": 2}, "0 <= min <= max"),
    ({"min": 0, "max": 0}, "max >= 1"),
    ({"min": 1.5, "max": 2}, "whole numbers"),
    ({"min": True, "max": 2}, "whole numbers"),
    ({"min": -1, "max": 2}, "0 <= min"),
    ({"min": 1}, "{min: A, max: B}"),
    ({"min": 1, "max": 2, "step": 1}, "{min: A, max: B}"),
])
def test_bad_range_is_one_line_naming_pool_and_fix(islands, fix):
    message = refused(pools({"name": "spot", "islands": islands}))
    assert "pool 'spot'" in message and fix in message
    assert "e.g. islands: {min: 2, max: 6}" in message


def test_min_islands_conflicting_with_range_min_is_refused():
    message = refused(pools({**ELASTIC, "min_islands": 2}))
    assert "pool 'spot'" in message and "islands.min 1 conflicts with min_islands 2" in message


def test_min_islands_above_islands_is_refused():
    message = refused(pools({"name": "spot", "islands": 2, "min_islands": 3}))
    assert "pool 'spot'" in message and "min_islands 3 exceeds islands 2" in message


def test_every_pool_min_zero_is_refused():
    message = refused(pools({"name": "a", "islands": {"min": 0, "max": 2}}, {"name": "b", "islands": {"min": 0, "max": 1}}))
    assert "islands.min is 0" in message and "islands.min >= 1" in message


# --- properties --------------------------------------------------------------------------------


def test_required_islands_sums_minimums_and_fixed_slots():
    cfg = build_config(pools({"name": "f", "islands": 2}, ELASTIC, {"name": "g", "islands": {"min": 2, "max": 3}}))
    assert cfg.num_islands == 2 + 4 + 3
    assert cfg.required_islands == 2 + 1 + 2


def test_elastic_slots_are_numbered_over_pools_in_config_order():
    cfg = build_config(pools({"name": "f", "islands": 2}, ELASTIC, {"name": "g", "islands": 1},
                             {"name": "h", "islands": {"min": 1, "max": 2}}))
    # slots: f 0-1, spot 2-5, g 6, h 7-8
    assert cfg.elastic_slots() == frozenset({2, 3, 4, 5, 7, 8})


def test_no_elastic_slots_in_a_fixed_config():
    cfg = build_config(pools({"name": "f", "islands": 2}, {"name": "g", "islands": {"min": 1, "max": 1}}))
    assert cfg.elastic_slots() == frozenset()


def test_spares_and_reserved_bundles():
    cfg = build_config(pools({"name": "f", "islands": 2}, {**ELASTIC, "workers_per_island": 2},
                             {"name": "s", "islands": {"min": 2, "max": 5}}))
    f, spot, s = cfg.pools
    assert (f.spares, spot.spares, s.spares) == (True, False, False)
    assert f.reserved_bundles(warm_spares=1) == 2 + 1
    assert spot.reserved_bundles(warm_spares=1) == 1 * 2, "required islands x workers, no spare"
    assert s.reserved_bundles(warm_spares=3) == 2, "an elastic pool's minimum only, no spare"


def test_min_quorum_may_count_elastic_slots():
    cfg = build_config({**pools({"name": "f", "islands": 1}, ELASTIC), "outer": {"min_quorum": 5}})
    assert cfg.min_quorum_count() == 5
    assert "exceeds the 5 islands" in refused({**pools({"name": "f", "islands": 1}, ELASTIC), "outer": {"min_quorum": 6}})


# --- --set overrides ---------------------------------------------------------------------------


def with_spot(*overrides: str) -> PoolConfig:
    """The spot pool of a config with a fixed pool and ELASTIC, after `overrides`."""
    return pool(build_config(apply_overrides(pools({"name": "f", "islands": 1}, ELASTIC), list(overrides))), "spot")


def test_set_range_max_keeps_the_pool_elastic():
    p = with_spot("pools.spot.islands.max=6")
    assert (p.islands, p.min_islands, p.elastic) == (6, 1, True)


def test_set_whole_range_replaces_it():
    p = with_spot("pools.spot.islands={min: 2, max: 5}")
    assert (p.islands, p.min_islands, p.elastic) == (5, 2, True)


def test_set_islands_int_on_a_written_range_makes_a_fixed_pool():
    # A plain int means a fixed pool, also when it replaces a range written in the file.
    p = with_spot("pools.spot.islands=3")
    assert (p.islands, p.min_islands, p.elastic) == (3, None, False)


def test_set_min_islands_conflicting_with_written_range_names_both():
    with pytest.raises(ConfigError, match="islands.min 1 conflicts with min_islands 2"):
        with_spot("pools.spot.min_islands=2")


def test_apply_overrides_leaves_the_input_alone():
    data = pools(ELASTIC)
    apply_overrides(data, ["pools.spot.islands=3"])
    assert data == pools(ELASTIC)


def test_load_config_file_with_range_and_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pools:\n  - {name: f, islands: 1}\n  - {name: spot, islands: {min: 1, max: 4}}\n")
    cfg = load_config(path, overrides=["pools.spot.islands.min=2"])
    assert (pool(cfg, "spot").islands, pool(cfg, "spot").min_islands) == (4, 2)
    assert cfg.required_islands == 3 and cfg.elastic_slots() == frozenset({1, 2, 3, 4})


def test_resolved_config_round_trips_and_keeps_elasticity():
    # A run directory's config.yaml is model_dump(mode="json"): islands B and min_islands A as two fields.
    cfg = build_config(pools({"name": "f", "islands": 1}, ELASTIC))
    again = build_config(cfg.model_dump(mode="json"))
    assert again == cfg and again.elastic_slots() == frozenset({1, 2, 3, 4})


def test_set_islands_int_on_a_resolved_config_keeps_its_minimum():
    # The resolved form (--resume, `diloco eval`) holds min_islands as a field of its own, so the same --set keeps
    # it: an elastic pool 1..3, where on the file spelling above it gives a fixed pool of 3. Pinned as it is today.
    dumped = build_config(pools({"name": "f", "islands": 1}, ELASTIC)).model_dump(mode="json")
    p = pool(build_config(apply_overrides(dumped, ["pools.spot.islands=3"])), "spot")
    assert (p.islands, p.min_islands, p.elastic) == (3, 1, True)
