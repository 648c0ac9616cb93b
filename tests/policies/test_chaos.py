"""Fault tapes: validation, ordering, YAML round trip, Poisson and fixed schedules, the CLI shorthand."""

import dataclasses
import math

import numpy as np
import pytest

from policies.chaos import (
    FAULT_KINDS,
    POISON_KINDS,
    RUN_KINDS,
    Fault,
    FaultTape,
    fixed_budget_tape,
    fixed_tape,
    parse_chaos_spec,
    poisson_tape,
    retarget_island,
    tape_from_config,
)

# --- Fault -------------------------------------------------------------------------------------


def test_fault_defaults_and_coercion():
    f = Fault(island=2, kind="kill_island", at_s=3)
    assert f == Fault(2, "kill_island", 3.0, None, 1, 0.0, 1.0)
    assert isinstance(f.at_s, float)
    assert Fault(island=0, kind="hang", at_step=np.int64(7), incarnation=2).at_step == 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"island": 0, "kind": "kill_island"}, "exactly one of at_s / at_step"),
        ({"island": 0, "kind": "kill_island", "at_s": 1.0, "at_step": 3}, "exactly one of at_s / at_step"),
        ({"island": -1, "kind": "kill_island", "at_s": 1.0}, "island must be an int >= 0, got -1"),
        ({"island": True, "kind": "kill_island", "at_s": 1.0}, "island must be an int"),
        ({"island": 0, "kind": "explode", "at_s": 1.0}, "kind must be one of .*'explode'"),
        ({"island": 0, "kind": "hang", "at_s": -0.5}, "at_s must be a finite number >= 0, got -0.5"),
        ({"island": 0, "kind": "hang", "at_s": math.inf}, "at_s must be a finite"),
        ({"island": 0, "kind": "hang", "at_step": 1.5}, "at_step must be an int >= 0, got 1.5"),
        ({"island": 0, "kind": "hang", "at_step": 1, "incarnation": 0}, "incarnation must be an int >= 1, got 0"),
        ({"island": 0, "kind": "hang", "at_s": 1.0, "duration_s": -1}, "duration_s must be a finite number >= 0"),
        ({"island": 0, "kind": "slow", "at_s": 1.0}, "factor of a slow fault must be > 1, got 1.0"),
        ({"island": 0, "kind": "slow", "at_s": 1.0, "factor": 0.5}, "must be > 1, got 0.5"),
        ({"island": 0, "kind": "hang", "at_s": 1.0, "factor": 3.0}, "factor only applies to kind 'slow'"),
    ],
)
def test_fault_validation_is_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        Fault(**kwargs)
    assert "\n" not in str(info.value)


# --- FaultTape ---------------------------------------------------------------------------------


def _mixed_faults():
    return [
        Fault(island=1, kind="hang", at_step=10, incarnation=2),
        Fault(island=0, kind="slow", at_s=5.0, duration_s=3.0, factor=2.5),
        Fault(island=2, kind="kill_node", at_s=0.0, duration_s=4.0),
        Fault(island=0, kind="drop_submission", at_step=10),
        Fault(island=1, kind="kill_island", at_s=5.0),
    ]


def test_tape_sorted_by_time_then_step_then_island():
    tape = FaultTape(tuple(_mixed_faults()))
    keys = [(f.at_s, f.at_step, f.island) for f in tape.faults]
    # at_s=0.0 sorts first (0.0 is not "unset"), step faults after every time fault.
    assert keys == [(0.0, None, 2), (5.0, None, 0), (5.0, None, 1), (None, 10, 0), (None, 10, 1)]
    assert FaultTape(tuple(reversed(_mixed_faults()))) == tape
    assert len(tape) == 5 and len(FaultTape()) == 0


def test_for_island_and_count():
    tape = FaultTape(tuple(_mixed_faults()))
    assert [f.kind for f in tape.for_island(0)] == ["slow", "drop_submission"]
    assert [f.kind for f in tape.for_island(1)] == ["kill_island", "hang"]
    assert tape.for_island(7) == []
    assert tape.count() == 5 and tape.count("hang") == 1


def test_tape_rejects_non_faults():
    with pytest.raises(ValueError, match=r"faults\[0\] must be a Fault, got dict"):
        FaultTape(({"island": 0},))


def test_dict_and_yaml_round_trip(tmp_path):
    tape = FaultTape(tuple(_mixed_faults()))
    d = tape.to_dict()
    assert d["faults"][0] == {"island": 2, "kind": "kill_node", "at_s": 0.0, "incarnation": 1,
                              "duration_s": 4.0, "factor": 1.0}
    assert FaultTape.from_dict(d) == tape
    path = tmp_path / "tape.yaml"
    tape.to_yaml(path)
    assert FaultTape.from_yaml(path) == tape
    poisson = poisson_tape(islands=3, horizon_s=500.0, mtbf_s=50.0, seed=11, recovery_delay_s=(1.0, 9.0))
    poisson.to_yaml(path)
    assert FaultTape.from_yaml(path) == poisson  # floats round-trip exactly


def test_hand_written_yaml(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("faults:\n  - {island: 1, kind: hang, at_step: 40, incarnation: 2}\n"
                    "  - {island: 0, kind: kill_island, at_s: 12, duration_s: 3}\n")
    tape = FaultTape.from_yaml(path)
    assert tape.faults == (Fault(0, "kill_island", at_s=12.0, duration_s=3.0),
                           Fault(1, "hang", at_step=40, incarnation=2))


def test_yaml_errors_are_one_line_and_name_the_key(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("faults:\n  - {island: 0, kind: hang, at_s: 1, when: 3}\n")
    with pytest.raises(ValueError, match=r"faults\[0\]: unknown fault key 'when'") as info:
        FaultTape.from_yaml(path)
    assert "\n" not in str(info.value)
    path.write_text("faults: []\nseed: 3\n")
    with pytest.raises(ValueError, match="unknown fault tape key 'seed'"):
        FaultTape.from_yaml(path)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        FaultTape.from_yaml(path)
    path.write_text("faults:\n  - {kind: hang, at_s: 1}\n")
    with pytest.raises(ValueError, match="lacks required key 'island'"):
        FaultTape.from_yaml(path)
    path.write_text("faults:\n  - {island: 0, kind: hang, at_s: -1}\n")
    with pytest.raises(ValueError, match=r"faults\[0\]: Fault.at_s must be"):
        FaultTape.from_yaml(path)
    path.write_text("faults: []\n")
    assert len(FaultTape.from_yaml(path)) == 0


# --- poisson_tape ------------------------------------------------------------------------------


def test_poisson_same_seed_same_tape_other_seed_other_tape():
    kw = dict(islands=4, horizon_s=1000.0, mtbf_s=100.0, kinds=("kill_island", "hang"))
    a = poisson_tape(seed=5, **kw)
    assert a == poisson_tape(seed=5, **kw)
    assert a != poisson_tape(seed=6, **kw)
    assert len(a) > 0


def test_poisson_island_streams_do_not_depend_on_island_count():
    small = poisson_tape(islands=2, horizon_s=1000.0, mtbf_s=100.0, seed=1)
    big = poisson_tape(islands=5, horizon_s=1000.0, mtbf_s=100.0, seed=1)
    for m in range(2):
        assert small.for_island(m) == big.for_island(m)


def test_poisson_rate_over_long_horizon():
    # 2000 expected events per island; the count's std is ~45, so 10% (200) is > 4 sigma.
    tape = poisson_tape(islands=3, horizon_s=200_000.0, mtbf_s=100.0, seed=0)
    for m in range(3):
        assert abs(len(tape.for_island(m)) - 2000) < 200
    gaps = np.diff([f.at_s for f in tape.for_island(0)])
    assert abs(gaps.mean() - 100.0) < 10.0


def test_poisson_window_kinds_weights_and_recovery_delay():
    tape = poisson_tape(islands=2, horizon_s=20_000.0, mtbf_s=10.0, seed=2, start_s=100.0,
                        kinds=("kill_island", "kill_node", "hang", "slow"), kind_weights=(6, 2, 1, 1),
                        recovery_delay_s=(2.0, 5.0), slow_factor=3.0, slow_duration_s=7.0)
    assert all(100.0 < f.at_s < 20_000.0 for f in tape)
    n = len(tape)
    assert abs(tape.count("kill_island") / n - 0.6) < 0.03
    assert abs(tape.count("kill_node") / n - 0.2) < 0.03
    kills = [f for f in tape if f.kind in ("kill_island", "kill_node")]
    delays = np.array([f.duration_s for f in kills])
    assert delays.min() >= 2.0 and delays.max() <= 5.0 and abs(delays.mean() - 3.5) < 0.1
    assert all(f.factor == 3.0 and f.duration_s == 7.0 for f in tape if f.kind == "slow")
    assert all(f.duration_s == 0.0 for f in tape if f.kind == "hang")


def test_poisson_min_gap_shifts_and_keeps_spacing():
    tape = poisson_tape(islands=2, horizon_s=100_000.0, mtbf_s=20.0, seed=4, min_gap_s=30.0)
    for m in range(2):
        times = np.array([f.at_s for f in tape.for_island(m)])
        gaps = np.diff(times)
        assert gaps.min() >= 30.0
        # Shift, not resample: the gap is min_gap_s + Exp(mtbf_s), mean 50 s.
        assert abs(gaps.mean() - 50.0) < 2.5
        assert abs((gaps - 30.0).mean() - 20.0) < 1.0


def test_poisson_rare_faults_give_an_empty_tape():
    assert len(poisson_tape(islands=2, horizon_s=1.0, mtbf_s=1e9, seed=0)) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mtbf_s": 0.0}, "mtbf_s must be a finite number > 0, got 0.0"),
        ({"islands": 0}, "islands must be an int >= 1, got 0"),
        ({"horizon_s": 5.0, "start_s": 5.0}, "horizon_s must be finite and > start_s=5.0"),
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"kinds": ()}, "kinds must name at least one"),
        ({"kinds": ("nuke",)}, "unknown fault kind 'nuke'"),
        ({"kinds": ("hang", "slow"), "kind_weights": (1.0,)}, "one weight per kind"),
        ({"kind_weights": (0.0,)}, "not all 0"),
        ({"recovery_delay_s": (3.0, 1.0)}, r"0 <= lo <= hi < inf, got \(3.0, 1.0\)"),
        ({"min_gap_s": -1.0}, "min_gap_s must be finite and >= 0"),
        ({"slow_factor": 1.0}, "slow_factor must be > 1"),
    ],
)
def test_poisson_validation(kwargs, match):
    base = dict(islands=2, horizon_s=100.0, mtbf_s=10.0, seed=0)
    with pytest.raises(ValueError, match=match):
        poisson_tape(**{**base, **kwargs})


# --- fixed_tape --------------------------------------------------------------------------------


def test_fixed_tape_exact_counts_and_spacing():
    islands, n, start, horizon = 4, 3, 10.0, 130.0
    tape = fixed_tape(islands=islands, failures_per_island=n, horizon_s=horizon, start_s=start, seed=7)
    assert len(tape) == islands * n
    period = (horizon - start) / n  # 40 s
    for m in range(islands):
        times = [f.at_s for f in tape.for_island(m)]
        assert len(times) == n
        assert np.allclose(np.diff(times), period)
        assert start < times[0] < start + period
    all_times = np.array([f.at_s for f in tape])
    assert np.allclose(np.diff(all_times), period / islands)  # 10 s between any two faults
    assert all(start < t < horizon for t in all_times)
    assert all(f.kind == "kill_island" and f.duration_s == 0.0 for f in tape)


def test_fixed_tape_deterministic_and_seeded():
    kw = dict(islands=3, failures_per_island=2, horizon_s=60.0)
    assert fixed_tape(**kw, seed=1) == fixed_tape(**kw, seed=1)
    assert fixed_tape(**kw, seed=1) != fixed_tape(**kw, seed=2)


def test_fixed_tape_single_island_hand_computed():
    # One island: u = (0 + 0.5 + phase) / 1 with phase in (-0.5, 0.5), so faults at (j + u) * 10.
    tape = fixed_tape(islands=1, failures_per_island=2, horizon_s=20.0, seed=0)
    t0, t1 = (f.at_s for f in tape)
    assert 0.0 < t0 < 10.0 and t1 == pytest.approx(t0 + 10.0)


def test_fixed_tape_slow_kind_and_validation():
    tape = fixed_tape(islands=2, failures_per_island=1, horizon_s=10.0, kind="slow", slow_factor=5.0)
    assert all(f.kind == "slow" and f.factor == 5.0 for f in tape)
    with pytest.raises(ValueError, match="failures_per_island must be an int >= 1, got 0"):
        fixed_tape(islands=2, failures_per_island=0, horizon_s=10.0)
    with pytest.raises(ValueError, match="unknown fault kind 'boom'"):
        fixed_tape(islands=2, failures_per_island=1, horizon_s=10.0, kind="boom")


def test_fixed_budget_tape_spreads_fixed_tapes_schedule_over_the_token_budget():
    islands, n, start, until = 4, 3, 0.1, 0.7
    tape = fixed_budget_tape(islands=islands, failures_per_island=n, start=start, until=until, seed=7)
    assert len(tape) == islands * n
    period = (until - start) / n  # 0.2 of the budget
    for m in range(islands):
        at = [f.at_progress for f in tape.for_island(m)]
        assert np.allclose(np.diff(at), period) and start < at[0] < start + period
    every = np.array([f.at_progress for f in tape])
    assert np.allclose(np.diff(every), period / islands)  # 0.05 of the budget between any two faults
    assert all(start < p < until for p in every) and all(f.at_s is None for f in tape)
    on_clock = fixed_tape(islands=islands, failures_per_island=n, horizon_s=until, start_s=start, seed=7)
    assert [f.at_progress for f in tape] == [f.at_s for f in on_clock]


def test_fixed_faults_fall_inside_the_token_budget_whatever_the_run_lasts():
    # The README's `--chaos fixed:failures=3`: every island killed 3 times. Placed on the clock over a horizon the
    # run never reached, faults did not fire ("10 of 12 planned"); on the budget's progress all 12 fall before 0.9
    # of it, in a run of any length.
    tape = tape_from_config(parse_chaos_spec("fixed:failures=3"), islands=4, horizon_s=180.0)
    assert len(tape) == 12 and all(len(tape.for_island(m)) == 3 for m in range(4))
    assert all(f.at_s is None and 0.0 < f.at_progress < 0.9 for f in tape)


def test_fixed_budget_tape_validation():
    assert fixed_budget_tape(islands=2, failures_per_island=1, seed=3) == fixed_budget_tape(islands=2, failures_per_island=1, seed=3)
    with pytest.raises(ValueError, match="0 <= start < until < 1, got start=0.5, until=0.5"):
        fixed_budget_tape(islands=2, failures_per_island=1, start=0.5, until=0.5)
    with pytest.raises(ValueError, match="failures_per_island must be an int >= 1, got 0"):
        fixed_budget_tape(islands=2, failures_per_island=0)


def test_a_progress_fault_round_trips_and_is_checked():
    f = Fault(island=1, kind="hang", at_progress=0.25)
    assert Fault.from_dict(f.to_dict()) == f and "at_s" not in f.to_dict()
    with pytest.raises(ValueError, match="exactly one of at_s / at_step / at_progress"):
        Fault(island=0, kind="hang", at_s=1.0, at_progress=0.5)
    with pytest.raises(ValueError, match=r"at_progress must be a number in \[0, 1\), got 1.0"):
        Fault(island=0, kind="hang", at_progress=1.0)
    tape = FaultTape((Fault(island=0, kind="hang", at_step=3), f, Fault(island=2, kind="hang", at_s=9.0)))
    assert [x.island for x in tape] == [2, 1, 0]  # time, then progress, then step faults


# --- parse_chaos_spec / tape_from_config -------------------------------------------------------


def test_parse_none_and_tape_forms():
    assert parse_chaos_spec("none") == {"mode": "none"}
    assert parse_chaos_spec(" None ") == {"mode": "none"}
    assert parse_chaos_spec("tape:runs/t.yaml") == {"mode": "tape", "path": "runs/t.yaml"}
    assert parse_chaos_spec("tape:faults.txt") == {"mode": "tape", "path": "faults.txt"}
    assert parse_chaos_spec("configs/chaos.yml") == {"mode": "tape", "path": "configs/chaos.yml"}
    assert parse_chaos_spec("t.yaml") == {"mode": "tape", "path": "t.yaml"}


def test_parse_poisson():
    d = parse_chaos_spec("poisson:mtbf_s=60,seed=3,kinds=kill_island|hang")
    assert d == {"mode": "poisson", "mtbf_s": 60.0, "seed": 3, "kinds": ["kill_island", "hang"],
                 "kind_weights": None, "recovery_delay_s": [0.0, 0.0], "min_gap_s": 0.0, "start_s": 0.0,
                 "slow_factor": 4.0, "slow_duration_s": 0.0, "drain_deadline_s": 20.0, "retarget": False}
    assert parse_chaos_spec("poisson:mtbf_s=60,retarget=true")["retarget"] is True
    with pytest.raises(ValueError, match="retarget='yes' does not parse"):
        parse_chaos_spec("poisson:mtbf_s=60,retarget=yes")
    d = parse_chaos_spec("poisson:mtbf_s=30,kinds=hang|slow,kind_weights=3|1,recovery_delay_s=5,min_gap_s=10")
    assert d["seed"] == 0 and d["kind_weights"] == [3.0, 1.0] and d["recovery_delay_s"] == [5.0, 5.0]
    assert parse_chaos_spec("poisson:mtbf_s=30,recovery_delay_s=1|4")["recovery_delay_s"] == [1.0, 4.0]


def test_parse_fixed():
    assert parse_chaos_spec("fixed:failures=3") == {
        "mode": "fixed", "failures_per_island": 3, "seed": 0, "kind": "kill_island", "start": 0.0, "until": 0.9,
        "slow_factor": 4.0,
    }
    d = parse_chaos_spec("fixed:failures_per_island=2,kind=hang,start=0.2,until=0.6,seed=9")
    assert (d["failures_per_island"], d["kind"], d["start"], d["until"], d["seed"]) == (2, "hang", 0.2, 0.6, 9)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("sometimes", "unknown chaos spec 'sometimes'; valid forms: none"),
        ("", "unknown chaos spec ''"),
        ("tape:", "names no tape file"),
        ("poisson:seed=3", "needs mtbf_s"),
        ("poisson:mtbf_s", "'mtbf_s' is not KEY=VALUE"),
        ("poisson:mtbf_s=abc", "mtbf_s='abc' does not parse"),
        ("poisson:mtbf_s=-5", "mtbf_s must be a finite number > 0"),
        ("poisson:mtbf_s=5,rate=2", "unknown poisson key 'rate'; valid keys: mtbf_s"),
        ("poisson:mtbf_s=5,mtbf_s=6", "'mtbf_s' given twice"),
        ("poisson:mtbf_s=5,kinds=kill", "unknown fault kind 'kill'"),
        ("poisson:mtbf_s=5,recovery_delay_s=5|1", "lo <= hi"),
        ("poisson:mtbf_s=5,recovery_delay_s=1|2|3", "must be a pair"),
        ("fixed:kind=hang", "needs failures_per_island"),
        ("fixed:failures=0", "failures_per_island must be an int >= 1"),
        ("fixed:failures=2.5", "does not parse"),
        ("fixed:failures=2,mtbf_s=3", "unknown fixed key 'mtbf_s'"),
        ("fixed:failures=2,start_s=5", "unknown fixed key 'start_s'"),
        ("fixed:failures=2,until=1.5", "0 <= start < until < 1"),
    ],
)
def test_parse_errors_are_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_chaos_spec(spec)
    assert "\n" not in str(info.value)


def test_tape_from_config_builds_each_mode(tmp_path):
    assert len(tape_from_config({"mode": "none"}, islands=3, horizon_s=10.0)) == 0
    cfg = parse_chaos_spec("poisson:mtbf_s=20,seed=3,kinds=kill_island|hang,recovery_delay_s=1|2")
    assert tape_from_config(cfg, islands=3, horizon_s=300.0) == poisson_tape(
        islands=3, horizon_s=300.0, mtbf_s=20.0, seed=3, kinds=("kill_island", "hang"), recovery_delay_s=(1.0, 2.0)
    )
    fixed = tape_from_config(parse_chaos_spec("fixed:failures=3"), islands=4, horizon_s=120.0)
    assert tape_from_config({"mode": "fixed", "failures": 3}, islands=4, horizon_s=120.0) == fixed
    assert fixed == fixed_budget_tape(islands=4, failures_per_island=3) and len(fixed) == 12
    path = tmp_path / "t.yaml"
    fixed.to_yaml(path)
    assert tape_from_config(parse_chaos_spec(str(path)), islands=4, horizon_s=120.0) == fixed


def test_tape_from_config_errors():
    with pytest.raises(ValueError, match="chaos mode must be one of none, tape, poisson, fixed, got 'x'"):
        tape_from_config({"mode": "x"}, islands=1, horizon_s=1.0)
    with pytest.raises(ValueError, match="'none' takes no parameters"):
        tape_from_config({"mode": "none", "path": "a"}, islands=1, horizon_s=1.0)
    with pytest.raises(ValueError, match=r"'fixed' takes \['failures_per_island'"):
        tape_from_config({"mode": "fixed", "failures": 3, "failures_per_island": 3}, islands=1, horizon_s=1.0)
    with pytest.raises(ValueError, match=r"'poisson' takes \['mtbf_s'.*got \['mtbf_s', 'rate'\]"):
        tape_from_config({"mode": "poisson", "mtbf_s": 3, "rate": 1}, islands=1, horizon_s=1.0)


def test_every_kind_is_usable():
    for kind in FAULT_KINDS:
        tape = fixed_tape(islands=1, failures_per_island=1, horizon_s=1.0, kind=kind)
        assert tape.faults[0].kind == kind


# --- run kinds (the outer optimizer's and the monitor's kills) and poisoned submissions ------------------


def test_run_kinds_name_no_island_and_take_no_duration():
    for kind in RUN_KINDS:
        assert Fault(island=0, kind=kind, at_s=3.0).island == 0
        with pytest.raises(ValueError, match=f"island of a {kind} fault must be 0") as info:
            Fault(island=2, kind=kind, at_s=3.0)
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError, match=f"duration_s of a {kind} fault must be 0"):
            Fault(island=0, kind=kind, at_s=3.0, duration_s=5.0)
        with pytest.raises(ValueError, match="factor only applies to kind 'slow'"):
            Fault(island=0, kind=kind, at_s=3.0, factor=2.0)


def test_poison_kinds_take_a_duration_and_no_factor():
    assert set(POISON_KINDS) <= set(FAULT_KINDS)
    for kind in POISON_KINDS:
        assert Fault(island=3, kind=kind, at_s=1.0, duration_s=30.0).duration_s == 30.0
        assert Fault(island=3, kind=kind, at_step=4).duration_s == 0.0  # until the incarnation ends
        with pytest.raises(ValueError, match="factor only applies to kind 'slow'"):
            Fault(island=0, kind=kind, at_s=1.0, factor=100.0)


def test_new_kinds_keep_old_tapes_order():
    # Appended kinds: the index that orders faults of equal time is unchanged for the first eight.
    assert FAULT_KINDS[:8] == ("kill_island", "kill_node", "hang", "slow", "drop_submission", "corrupt_submission",
                               "drain_node", "node_joins")


def test_poisson_run_kinds_hit_the_run_once_not_once_per_island():
    # Weights 3:1 island:run kinds; 8 islands. Islands' faults: rate 0.75 / mtbf each; the run's: 0.25 / mtbf.
    kinds = ("kill_island", "hang", "kill_outer", "kill_monitor")
    tape = poisson_tape(islands=8, horizon_s=200_000.0, mtbf_s=100.0, seed=1, kinds=kinds, kind_weights=(2, 1, 0.5, 0.5))
    run = [f for f in tape if f.kind in RUN_KINDS]
    assert all(f.island == 0 and f.duration_s == 0.0 for f in run)
    # 500 expected run faults (std ~22) and 1500 per island (std ~39): 15% is > 3 sigma for both.
    assert abs(len(run) - 500) < 75, len(run)
    assert abs(tape.count("kill_outer") - tape.count("kill_monitor")) < 100
    for m in range(8):
        own = [f for f in tape.for_island(m) if f.kind not in RUN_KINDS]
        assert abs(len(own) - 1500) < 225, (m, len(own))
    gaps = np.diff([f.at_s for f in run])
    assert abs(gaps.mean() - 400.0) < 60.0  # a Poisson process of rate 0.25 / mtbf: thinned, not per island


def test_poisson_run_stream_does_not_depend_on_island_count_and_min_gap_holds():
    kw = dict(horizon_s=50_000.0, mtbf_s=20.0, seed=7, kinds=("kill_island", "kill_outer", "kill_monitor"), min_gap_s=60.0)
    small, big = poisson_tape(islands=1, **kw), poisson_tape(islands=6, **kw)
    run = lambda tape: [f for f in tape if f.kind in RUN_KINDS]  # noqa: E731
    assert run(small) == run(big) and len(run(small)) > 100
    assert np.diff([f.at_s for f in run(small)]).min() >= 60.0


def test_poisson_without_run_kinds_has_no_run_stream():
    # Island 0's draws are its own stream's, as before run kinds existed: the first fault's time is its first
    # exponential draw.
    tape = poisson_tape(islands=3, horizon_s=5000.0, mtbf_s=50.0, seed=2)
    first = float(np.random.default_rng([2, 0]).exponential(50.0))
    assert tape.for_island(0)[0].at_s == first
    assert all(f.kind == "kill_island" for f in tape) and len({f.island for f in tape}) == 3


def test_fixed_tape_of_a_run_kind_is_one_target():
    tape = fixed_tape(islands=4, failures_per_island=3, horizon_s=30.0, kind="kill_outer")
    assert len(tape) == 3 and all(f.island == 0 for f in tape)
    budget = fixed_budget_tape(islands=4, failures_per_island=2, kind="kill_monitor")
    assert len(budget) == 2 and all(f.island == 0 and f.at_progress is not None for f in budget)


def test_retarget_goes_to_the_next_live_island_wrapping_around():
    assert retarget_island(2, {0, 2, 5}) == 2  # live itself: no move
    assert retarget_island(3, {0, 2, 5}) == 5
    assert retarget_island(6, [5, 0, 2]) == 0  # past the last live one: wraps to the first
    assert retarget_island(1, []) is None  # none live: the fault waits


def test_poisson_tape_retarget_marks_island_faults_only_and_changes_no_draw():
    kinds = ("kill_island", "hang", "kill_outer")
    plain = poisson_tape(islands=3, horizon_s=600, mtbf_s=20, seed=4, kinds=kinds)
    marked = poisson_tape(islands=3, horizon_s=600, mtbf_s=20, seed=4, kinds=kinds, retarget=True)
    assert [dataclasses.replace(f, retarget=False) for f in marked] == list(plain)
    assert {f.retarget for f in marked if f.kind != "kill_outer"} == {True}
    assert {f.retarget for f in marked if f.kind == "kill_outer"} == {False}
    back = FaultTape.from_dict(marked.to_dict())
    assert back == marked and "retarget" not in plain.to_dict()["faults"][0]


@pytest.mark.parametrize("fault, match", [
    (dict(island=0, kind="hang", at_step=3, retarget=True), "retarget needs an at_s or at_progress trigger"),
    (dict(island=0, kind="kill_outer", at_s=3.0, retarget=True), "'kill_outer' hits the run itself"),
    (dict(island=0, kind="hang", at_s=3.0, retarget=1), "retarget must be true or false, got 1"),
])
def test_retarget_refuses_what_it_cannot_mean(fault, match):
    with pytest.raises(ValueError, match=match):
        Fault(**fault)
    with pytest.raises(ValueError, match="retarget must be true or false"):
        poisson_tape(islands=1, horizon_s=10, mtbf_s=1, seed=0, retarget="yes")
