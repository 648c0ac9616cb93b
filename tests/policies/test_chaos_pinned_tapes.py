"""Tapes drawn from a seed stay what they were: the faults of a few tapes, pinned.

The expected values were computed with policies/chaos.py at commit 4351c6d, before fault kinds moved into
policies/fault_kinds.py (issue 58 item 3), by the very calls below; a change to how tapes draw, order or fill in
faults fails here. The long tapes are pinned by a SHA-256 of their canonical JSON (``FaultTape.to_dict``).
"""

import hashlib
import json

from policies.chaos import FAULT_KINDS, Fault, FaultTape, fixed_budget_tape, fixed_tape, poisson_tape

# (island, kind, at_s, at_step, incarnation, duration_s, factor, at_progress)
Row = tuple[int, str, float | None, int | None, int, float, float, float | None]


def rows(tape: FaultTape) -> list[Row]:
    return [(f.island, f.kind, f.at_s, f.at_step, f.incarnation, f.duration_s, f.factor, f.at_progress) for f in tape]


def digest(tape: FaultTape) -> str:
    return hashlib.sha256(json.dumps(tape.to_dict(), sort_keys=True).encode()).hexdigest()


def test_poisson_tape_of_island_and_run_kinds_is_pinned():
    tape = poisson_tape(islands=2, horizon_s=120.0, mtbf_s=15.0, seed=3,
                        kinds=("kill_island", "kill_node", "hang", "slow", "drop_submission", "drain_node", "kill_outer",
                               "scaled_submission"),
                        recovery_delay_s=(1.0, 4.0), min_gap_s=2.0, start_s=5.0, slow_factor=3.0, slow_duration_s=6.0,
                        drain_deadline_s=12.0)
    assert rows(tape) == [
        (0, 'kill_node', 6.650222190170598, None, 1, 3.403823395619191, 1.0, None),
        (1, 'slow', 8.689718450041813, None, 1, 6.0, 3.0, None),
        (1, 'drop_submission', 13.262178827160495, None, 1, 0.0, 1.0, None),
        (0, 'kill_island', 41.65244362689131, None, 1, 2.2993808207094215, 1.0, None),
        (0, 'kill_node', 50.17064133788151, None, 1, 3.2037314542276434, 1.0, None),
        (0, 'slow', 53.16526192864578, None, 1, 6.0, 3.0, None),
        (1, 'drop_submission', 58.138567820085306, None, 1, 0.0, 1.0, None),
        (0, 'drop_submission', 59.16323261104106, None, 1, 0.0, 1.0, None),
        (1, 'drop_submission', 66.41921606011039, None, 1, 0.0, 1.0, None),
        (1, 'scaled_submission', 83.30879613425348, None, 1, 0.0, 1.0, None),
        (0, 'hang', 91.6770657365011, None, 1, 0.0, 1.0, None),
        (0, 'kill_outer', 96.84185395579529, None, 1, 0.0, 1.0, None),
        (0, 'hang', 98.01637991228438, None, 1, 0.0, 1.0, None),
        (0, 'kill_outer', 101.16350567997566, None, 1, 0.0, 1.0, None),
        (1, 'kill_node', 116.54107694698332, None, 1, 2.4734233921336184, 1.0, None),
        (0, 'hang', 117.49175399368713, None, 1, 0.0, 1.0, None),
    ]


def test_poisson_tape_of_the_run_stream_is_pinned():
    tape = poisson_tape(islands=1, horizon_s=100.0, mtbf_s=20.0, seed=9,
                        kinds=("kill_outer", "kill_monitor", "corrupt_submission"), kind_weights=(1, 1, 2))
    assert rows(tape) == [
        (0, 'corrupt_submission', 85.75272198138909, None, 1, 0.0, 1.0, None),
        (0, 'kill_outer', 97.1633666668388, None, 1, 0.0, 1.0, None),
    ]


def test_fixed_tapes_are_pinned():
    assert rows(fixed_tape(islands=3, failures_per_island=1, horizon_s=30.0, kind="slow", seed=4, slow_factor=5.0)) == [
        (0, 'slow', 5.113275528143617, None, 1, 0.0, 5.0, None),
        (1, 'slow', 15.113275528143614, None, 1, 0.0, 5.0, None),
        (2, 'slow', 25.113275528143618, None, 1, 0.0, 5.0, None),
    ]
    assert rows(fixed_tape(islands=2, failures_per_island=2, horizon_s=40.0, kind="drain_node", start_s=1.0, seed=2)) == [
        (0, 'drain_node', 3.910288648287702, None, 1, 20.0, 1.0, None),
        (1, 'drain_node', 13.660288648287702, None, 1, 20.0, 1.0, None),
        (0, 'drain_node', 23.410288648287704, None, 1, 20.0, 1.0, None),
        (1, 'drain_node', 33.160288648287704, None, 1, 20.0, 1.0, None),
    ]
    assert rows(fixed_budget_tape(islands=3, failures_per_island=2, kind="kill_monitor", seed=5)) == [
        (0, 'kill_monitor', None, None, 1, 0.0, 1.0, 0.2711911184604741),
        (0, 'kill_monitor', None, None, 1, 0.0, 1.0, 0.7211911184604741),
    ]
    assert rows(fixed_budget_tape(islands=2, failures_per_island=1, kind="node_joins", start=0.2, until=0.8, seed=1)) == [
        (0, 'node_joins', None, None, 1, 0.0, 1.0, 0.48513910889778067),
        (1, 'node_joins', None, None, 1, 0.0, 1.0, 0.7851391088977806),
    ]


def test_long_tapes_of_every_kind_are_pinned():
    big = poisson_tape(islands=6, horizon_s=3000.0, mtbf_s=10.0, seed=17, kinds=FAULT_KINDS, recovery_delay_s=(0.5, 3.0),
                       min_gap_s=1.0, kind_weights=tuple(range(1, len(FAULT_KINDS) + 1)))
    assert len(big) == 1301 and {f.kind for f in big} == set(FAULT_KINDS)
    assert digest(big) == "df5f77b02ae48f6da6aae29ce279bd75aa20890ff392d2a4fd8ef15fb9109c28"
    fixed = [fixed_budget_tape(islands=3, failures_per_island=2, kind=k, seed=i) for i, k in enumerate(FAULT_KINDS)]
    assert sum(len(t) for t in fixed) == 76
    assert hashlib.sha256("".join(digest(t) for t in fixed).encode()).hexdigest() == (
        "8215dd6227d0b2544cb852d8605b616db8a0e588fcc97152e068feedb1c5338d")


def test_faults_of_equal_time_sort_in_the_kinds_declared_order():
    tape = FaultTape(tuple(Fault(island=0, kind=k, at_s=1.0, duration_s=5.0 if k == "drain_node" else 0.0,
                                 factor=2.0 if k == "slow" else 1.0) for k in reversed(FAULT_KINDS)))
    assert [f.kind for f in tape] == [
        'kill_island', 'kill_node', 'hang', 'slow', 'drop_submission', 'corrupt_submission', 'drain_node', 'node_joins',
        'scaled_submission', 'flipped_submission', 'stale_submission', 'noise_submission', 'kill_outer', 'kill_monitor']
