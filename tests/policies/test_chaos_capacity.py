"""Chaos capacity kinds: drain_node (a node drained with a deadline) and node_joins (a node for a pool joins).

Pins what policies/chaos.py's docstring says of them: a drain's duration_s is its deadline and must be > 0;
Poisson tapes give drains `drain_deadline_s` and joins 0 (the node stays), reproducibly by seed; the CLI
shorthand carries drain_deadline_s through tape_from_config; fixed tapes drain with DRAIN_DEADLINE_S; a bad
deadline is a one-line error.
"""

import math

import pytest

from policies.chaos import (
    CAPACITY_KINDS,
    DRAIN_DEADLINE_S,
    FAULT_KINDS,
    Fault,
    FaultTape,
    fixed_tape,
    parse_chaos_spec,
    poisson_tape,
    tape_from_config,
)

SPEC = "poisson:mtbf_s=30,kinds=drain_node|node_joins,drain_deadline_s=15"


def one_line_error(fn, *args, **kwargs) -> str:
    """The message of the ValueError fn raises, checked to be one line."""
    with pytest.raises(ValueError) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def capacity_tape(seed: int = 3, **kw) -> FaultTape:
    return poisson_tape(islands=4, horizon_s=300.0, mtbf_s=30.0, seed=seed, kinds=["drain_node", "node_joins"], **kw)


# --- Fault ---------------------------------------------------------------------------------------


def test_capacity_kinds_are_fault_kinds():
    assert set(CAPACITY_KINDS) == {"drain_node", "node_joins"} and set(CAPACITY_KINDS) <= set(FAULT_KINDS)


def test_drain_needs_a_deadline():
    message = one_line_error(Fault, island=0, kind="drain_node", at_s=5.0)
    assert "drain_node" in message and "must be > 0" in message and "duration_s=20" in message
    assert Fault(island=0, kind="drain_node", at_s=5.0, duration_s=15).duration_s == 15.0


def test_join_may_stay_or_leave():
    assert Fault(island=1, kind="node_joins", at_s=5.0).duration_s == 0.0
    assert Fault(island=1, kind="node_joins", at_s=5.0, duration_s=30).duration_s == 30.0


@pytest.mark.parametrize("kind", CAPACITY_KINDS)
def test_capacity_kinds_take_no_factor(kind):
    assert "factor only applies" in one_line_error(Fault, island=0, kind=kind, at_s=1.0, duration_s=5.0, factor=2.0)


def test_drain_without_deadline_in_a_yaml_tape_names_the_fault(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("faults:\n  - {island: 0, kind: node_joins, at_s: 1}\n  - {island: 0, kind: drain_node, at_s: 9}\n")
    message = one_line_error(FaultTape.from_yaml, path)
    assert "faults[1]" in message and "drain_node" in message
    path.write_text("faults:\n  - {island: 0, kind: drain_node, at_s: 9, duration_s: 12}\n")
    assert FaultTape.from_yaml(path).faults == (Fault(0, "drain_node", at_s=9.0, duration_s=12.0),)


# --- Poisson tapes -------------------------------------------------------------------------------


def test_poisson_drains_get_the_deadline_and_joins_stay():
    tape = capacity_tape(drain_deadline_s=15)
    assert tape.count("drain_node") > 0 and tape.count("node_joins") > 0
    assert tape.count("drain_node") + tape.count("node_joins") == len(tape)
    assert {f.duration_s for f in tape if f.kind == "drain_node"} == {15.0}
    assert {f.duration_s for f in tape if f.kind == "node_joins"} == {0.0}
    assert all(f.factor == 1.0 and 0 < f.at_s < 300.0 for f in tape)


def test_poisson_drain_deadline_defaults_to_the_constant():
    assert {f.duration_s for f in capacity_tape() if f.kind == "drain_node"} == {DRAIN_DEADLINE_S}


def test_poisson_capacity_tape_reproducible_by_seed():
    assert capacity_tape(seed=3, drain_deadline_s=15) == capacity_tape(seed=3, drain_deadline_s=15)
    assert capacity_tape(seed=3, drain_deadline_s=15) != capacity_tape(seed=4, drain_deadline_s=15)


def test_deadline_changes_only_durations():
    # The same seed draws the same times, islands and kinds whatever the deadline.
    a, b = capacity_tape(drain_deadline_s=15), capacity_tape(drain_deadline_s=40)
    assert [(f.island, f.kind, f.at_s) for f in a] == [(f.island, f.kind, f.at_s) for f in b]


@pytest.mark.parametrize("deadline", [0, -1, math.nan, math.inf])
def test_bad_drain_deadline_is_refused(deadline):
    message = one_line_error(capacity_tape, drain_deadline_s=deadline)
    assert "drain_deadline_s must be a finite number > 0" in message and "e.g. 20" in message


# --- the CLI shorthand ---------------------------------------------------------------------------


def test_spec_parses_capacity_kinds_and_deadline():
    spec = parse_chaos_spec(SPEC)
    assert spec["mode"] == "poisson" and spec["mtbf_s"] == 30.0
    assert spec["kinds"] == ["drain_node", "node_joins"] and spec["drain_deadline_s"] == 15.0


def test_spec_round_trips_through_tape_from_config():
    tape = tape_from_config(parse_chaos_spec(SPEC), islands=4, horizon_s=300.0)
    assert tape == poisson_tape(islands=4, horizon_s=300.0, mtbf_s=30.0, seed=0, kinds=["drain_node", "node_joins"],
                                drain_deadline_s=15.0)
    assert {f.duration_s for f in tape if f.kind == "drain_node"} == {15.0}


def test_spec_without_deadline_uses_the_constant():
    spec = parse_chaos_spec("poisson:mtbf_s=30,kinds=drain_node")
    assert spec["drain_deadline_s"] == DRAIN_DEADLINE_S
    tape = tape_from_config(spec, islands=2, horizon_s=200.0)
    assert len(tape) > 0 and {f.duration_s for f in tape} == {DRAIN_DEADLINE_S}


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_spec_with_bad_deadline_is_one_line(value):
    message = one_line_error(parse_chaos_spec, f"poisson:mtbf_s=30,kinds=drain_node,drain_deadline_s={value}")
    assert "drain_deadline_s must be a finite number > 0" in message


def test_spec_with_unparsable_deadline_is_one_line():
    assert "does not parse" in one_line_error(parse_chaos_spec, "poisson:mtbf_s=30,drain_deadline_s=soon")


# --- fixed tapes ---------------------------------------------------------------------------------


def test_fixed_drain_tape_uses_the_constant_deadline():
    tape = fixed_tape(islands=3, failures_per_island=2, horizon_s=120.0, kind="drain_node")
    assert len(tape) == 6 and {f.kind for f in tape} == {"drain_node"}
    assert {f.duration_s for f in tape} == {DRAIN_DEADLINE_S}


def test_fixed_join_tape_nodes_stay():
    tape = fixed_tape(islands=2, failures_per_island=1, horizon_s=60.0, kind="node_joins")
    assert len(tape) == 2 and {f.duration_s for f in tape} == {0.0}


def test_fixed_spec_drains_through_tape_from_config():
    tape = tape_from_config(parse_chaos_spec("fixed:failures=2,kind=drain_node"), islands=2, horizon_s=100.0)
    assert tape.count("drain_node") == 4 and {f.duration_s for f in tape} == {DRAIN_DEADLINE_S}
