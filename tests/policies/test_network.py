"""policies.network: exact link delays, FIFO serialization, the ring all-reduce formula, scaling, errors."""

import json
import math

import pytest

from policies.network import (
    REF_STEP_S,
    SCENARIOS,
    Link,
    LinkSchedule,
    NetworkModel,
    build_network,
    reference_ratio,
)


def star(**links: Link) -> NetworkModel:
    return NetworkModel("test", "hub", {"hub": Link(math.inf, 0.0), **links}, emulated=True)


def test_link_transfer_is_latency_plus_bits_over_bandwidth():
    link = Link(bandwidth_bps=8e6, latency_s=0.02)  # 1 MB/s
    assert link.transfer_s(0) == 0.02
    assert link.transfer_s(500_000) == pytest.approx(0.02 + 0.5)
    assert Link(math.inf, 0.0).transfer_s(10**12) == 0.0
    with pytest.raises(ValueError, match="bandwidth_bps must be > 0"):
        Link(0.0, 0.0)
    with pytest.raises(ValueError, match="latency_s must be finite"):
        Link(1e9, -1.0)


def test_schedule_is_fifo_per_link_and_direction_with_exact_times_and_bytes():
    net = star(a=Link(8e6, 0.1), b=Link(16e6, 0.0))  # a: 1 MB/s, b: 2 MB/s
    sched = LinkSchedule(net)
    # Two transfers ready together on a's uplink: the second starts when the first's last byte left
    # (1.0 s), not when it arrived (1.1 s); latency pipelines.
    assert sched.reserve("a", "up", 1_000_000, ready_at=10.0) == pytest.approx(11.1)
    assert sched.reserve("a", "up", 500_000, ready_at=10.0) == pytest.approx(11.6)
    # The downlink and other regions are independent links.
    assert sched.reserve("a", "down", 1_000_000, ready_at=10.0) == pytest.approx(11.1)
    assert sched.reserve("b", "up", 1_000_000, ready_at=10.0) == pytest.approx(10.5)
    # An idle link starts at ready_at: the queue drained at 11.5.
    assert sched.reserve("a", "up", 0, ready_at=20.0) == pytest.approx(20.1)
    assert sched.bytes_by_link() == {"a": {"up": 1_500_000, "down": 1_000_000}, "b": {"up": 1_000_000, "down": 0}}
    assert sched.transfers_by_link() == {"a": {"up": 3, "down": 1}, "b": {"up": 1, "down": 0}}
    sched.account("b", "down", 7)
    assert sched.bytes_by_link()["b"] == {"up": 1_000_000, "down": 7}
    with pytest.raises(ValueError, match="direction must be one of"):
        sched.reserve("a", "sideways", 1, 0.0)
    with pytest.raises(ValueError, match="region 'z' is not in network scenario 'test'"):
        sched.reserve("z", "up", 1, 0.0)


def test_counters_survive_a_restart_and_counting_goes_on_from_them():
    net = star(a=Link(8e6, 0.1), b=Link(16e6, 0.0))
    sched = LinkSchedule(net)
    sched.reserve("a", "up", 1_000, ready_at=0.0)
    sched.reserve("a", "up", 500, ready_at=0.0)
    sched.account("b", "down", 7)
    saved = sched.counters()
    assert saved == {"bytes": {"a": {"up": 1_500, "down": 0}, "b": {"up": 0, "down": 7}},
                     "transfers": {"a": {"up": 2, "down": 0}, "b": {"up": 0, "down": 1}}}
    again = LinkSchedule(net)  # a restarted owner: counts from the saved tables, queues empty
    again.restore_counters(json.loads(json.dumps(saved)))  # as a checkpoint's JSON metadata holds them
    assert again.counters() == saved
    assert again.reserve("a", "up", 1_000_000, ready_at=5.0) == pytest.approx(6.1)  # not behind the old queue
    again.account("b", "down", 3)
    assert again.bytes_by_link() == {"a": {"up": 1_001_500, "down": 0}, "b": {"up": 0, "down": 10}}
    assert again.transfers_by_link() == {"a": {"up": 3, "down": 0}, "b": {"up": 0, "down": 2}}


@pytest.mark.parametrize("bad", [
    None,
    {"bytes": {"a": {"up": 1, "down": 0}}},  # no transfers table
    {"bytes": {"a": {"up": 1}}, "transfers": {"a": {"up": 1, "down": 0}}},  # a direction missing
    {"bytes": {"a": {"up": -1, "down": 0}}, "transfers": {}},
    {"bytes": {}, "transfers": {"a": {"up": 1.5, "down": 0}}},
])
def test_malformed_counters_are_refused_in_one_line_and_change_nothing(bad):
    sched = LinkSchedule(star(a=Link(8e6, 0.1)))
    sched.account("a", "up", 9)
    before = sched.counters()
    with pytest.raises(ValueError, match="LinkSchedule.counters") as err:
        sched.restore_counters(bad)
    assert "\n" not in str(err.value)
    assert sched.counters() == before


def test_allreduce_matches_a_hand_computed_ring():
    net = star(a=Link(2e9, 0.020), b=Link(5e9, 0.015), c=Link(3e9, 0.010))
    nbytes = 24_000_000  # per worker, 4 workers
    # Hand: 2(n-1) = 6 steps; worst hop 20 + 15 ms; slowest link 2 Gbps carries 2*3/4 * 24 MB = 36 MB.
    expected = 6 * 0.035 + 36e6 * 8 / 2e9
    assert net.allreduce_s(nbytes, ["hub", "a", "b", "c"]) == pytest.approx(expected)
    assert expected == pytest.approx(0.354)
    # Two workers in one region: one hop up and down that region's link.
    assert net.allreduce_s(1000, ["c", "c"]) == pytest.approx(2 * 0.020 + 1000 * 8 / 3e9)
    assert net.allreduce_s(10**9, ["a"]) == 0.0
    assert NetworkModel.allreduce_bytes(24_000_000, 4) == 36_000_000
    assert NetworkModel.allreduce_bytes(10, 3) == 14  # ceil(2*2/3*10)
    assert NetworkModel.allreduce_bytes(10, 1) == 0


def test_none_has_no_delay_and_says_so():
    net = build_network("none", ["us-east", "eu-west"], model_bytes=0, local_step_s=0.0)
    assert not net.emulated and net.scale == 1.0
    assert net.transfer_s(10**9, "eu-west") == 0.0
    assert net.allreduce_s(10**9, ["us-east", "eu-west"]) == 0.0
    assert not net.describe().startswith("EMULATED")


def test_wan_scaling_keeps_the_12b_comm_to_compute_ratio():
    # Reference step: 6 * 12e9 * 2^22 tokens / (1024 chips * 459e12 * 0.4) FLOP/s.
    assert REF_STEP_S == pytest.approx(6 * 12e9 * 4_194_304 / (1024 * 459e12 * 0.4))
    assert REF_STEP_S == pytest.approx(1.6063, abs=1e-4)
    # R by hand: bf16 12B = 24e9 B; ring among 4 regions over the slowest 2 Gbps link, worst hop 20+15 ms.
    r_hand = (6 * 0.035 + 2 * 3 / 4 * 24e9 * 8 / 2e9) / REF_STEP_S
    regions = ["us-central", "us-east", "us-south", "us-west"]
    net = build_network("wan-4-regions", regions, model_bytes=4 * 500_000, local_step_s=0.1)
    assert net.hub == "us-central" and net.emulated
    assert reference_ratio(net.raw_links) == pytest.approx(r_hand)
    assert r_hand == pytest.approx(89.78, abs=0.01)
    # Our bf16 gradient (2 bytes x 500k params) all-reduced over the scaled links / our step = R.
    assert net.allreduce_s(2 * 500_000, regions) / 0.1 == pytest.approx(r_hand)
    assert net.scale == pytest.approx(0.1 / REF_STEP_S)
    assert net.byte_scale == pytest.approx(500_000 / 12e9)
    # Each link: bandwidth x byte_scale / scale, latency x scale.
    west = net.links["us-west"]
    assert west.bandwidth_bps == pytest.approx(2e9 * (500_000 / 12e9) / (0.1 / REF_STEP_S))
    assert west.latency_s == pytest.approx(0.020 * 0.1 / REF_STEP_S)
    assert net.describe().startswith("EMULATED network wan-4-regions")
    assert "at 0.1 s per inner step" in net.describe()


def test_eight_regions_and_lan_presets():
    net8 = build_network("wan-8-regions", ["eu-west", "us-east"], model_bytes=4_000, local_step_s=1.0)
    assert set(net8.links) == {"us-central", "us-east", "us-south", "us-west", "eu-west", "eu-central",
                               "asia-east", "asia-south"}
    # Data parallel among 8 regions needs ~209 Gbps to fit one all-reduce into one reference step.
    needed_bps = 2 * 7 / 8 * 24e9 * 8 / REF_STEP_S
    assert needed_bps == pytest.approx(209e9, rel=0.01)
    lan = build_network("lan", ["local", "other"], model_bytes=4 * 12_000_000_000, local_step_s=REF_STEP_S)
    assert lan.hub == "local" and lan.scale == pytest.approx(1.0) and lan.byte_scale == pytest.approx(1.0)
    assert lan.transfer_s(100_000_000, "other") == pytest.approx(50e-6 + 8e8 / 100e9)


def test_hub_region_override_swaps_the_star_centre():
    net = build_network("wan-4-regions", ["us-central", "us-west"], model_bytes=4 * 12_000_000_000,
                        local_step_s=REF_STEP_S, hub_region="us-east")
    assert net.hub == "us-east"
    assert net.raw_links["us-east"].latency_s == 50e-6  # the new hub is local
    assert net.raw_links["us-central"] == Link(5e9, 15e-3)  # the old hub takes us-east's old link


def test_bad_scenario_and_region_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown network scenario 'wan-5'; use one of none, lan, wan-4-regions"):
        build_network("wan-5", ["us-east"], model_bytes=4, local_step_s=1.0)
    with pytest.raises(ValueError, match=r"region 'eu-west' is not in network scenario 'wan-4-regions'.*us-central"):
        build_network("wan-4-regions", ["us-east", "eu-west"], model_bytes=4, local_step_s=1.0)
    with pytest.raises(ValueError, match="local_step_s must be > 0"):
        build_network("wan-4-regions", ["us-east"], model_bytes=4, local_step_s=0.0)
    with pytest.raises(ValueError, match="model_bytes must be > 0"):
        build_network("lan", ["x"], model_bytes=0, local_step_s=1.0)
    assert SCENARIOS == ("none", "lan", "wan-4-regions", "wan-8-regions")
    for msg in ("unknown network scenario", "is not in network scenario"):
        try:
            build_network("wan-5" if "unknown" in msg else "wan-4-regions", ["mars"], model_bytes=4, local_step_s=1.0)
        except ValueError as err:
            assert "\n" not in str(err) and msg in str(err)
