"""Where a pool's progress keeper goes (policies/keeper_placement.py), without Ray."""

from __future__ import annotations

from policies.keeper_placement import NODE_ID_LABEL, REGION_LABEL, keeper_selectors, matches, pool_nodes, should_move

NODES = {  # node id -> total resources, as ray.nodes() reports them
    "n1": {"CPU": 8.0, "pool_a": 1000.0},
    "n2": {"CPU": 8.0, "pool_a": 1000.0},
    "n3": {"CPU": 8.0, "pool_b": 1000.0},
    "n4": {"CPU": 8.0, "pool_a": 0.5},  # too little of the pool's resource for one bundle
}


def test_a_labelled_pool_prefers_its_nodes_without_islands_then_any_of_its_nodes():
    got = keeper_selectors({"pool": "a"}, {}, NODES, island_nodes={"n2", "n1"})
    assert got == [{"pool": "a", NODE_ID_LABEL: "!in(n1,n2)"}, {"pool": "a"}]


def test_a_pool_labelled_by_region_tries_its_regions_other_nodes_before_sharing_one_with_its_islands():
    # One node per pool and region (configs/multi-region.yaml): no island-free node of its own, but the
    # region's other pools' nodes keep the snapshots off the island's node and off the WAN.
    pool = {"pool": "h100", REGION_LABEL: "us-east"}
    got = keeper_selectors(pool, {}, NODES, island_nodes={"n1"})
    assert got == [{**pool, NODE_ID_LABEL: "!in(n1)"}, {REGION_LABEL: "us-east", NODE_ID_LABEL: "!in(n1)"}, pool]
    # A pool selected by its region alone: its own step already is the region's.
    assert keeper_selectors({REGION_LABEL: "eu"}, {}, NODES, island_nodes={"n1"}) == [
        {REGION_LABEL: "eu", NODE_ID_LABEL: "!in(n1)"}, {REGION_LABEL: "eu"}]
    # A pool that names its node itself still gets the region's other nodes first.
    pinned = {NODE_ID_LABEL: "n1", REGION_LABEL: "us-east"}
    assert keeper_selectors(pinned, {}, NODES, island_nodes={"n1"}) == [
        {REGION_LABEL: "us-east", NODE_ID_LABEL: "!in(n1)"}, pinned]


def test_a_labelled_pool_keeps_its_label_syntax_and_ignores_the_node_list():
    # A region given as a selector (not one region) adds no region step.
    got = keeper_selectors({"pool": "in(a,b)", "region": "!eu"}, {}, {}, island_nodes={"x"})
    assert got == [{"pool": "in(a,b)", "region": "!eu", NODE_ID_LABEL: "!in(x)"}, {"pool": "in(a,b)", "region": "!eu"}]
    got = keeper_selectors({"region": "in(eu,us)"}, {}, {}, island_nodes={"x"})
    assert got == [{"region": "in(eu,us)", NODE_ID_LABEL: "!in(x)"}, {"region": "in(eu,us)"}]


def test_a_labelled_pool_with_nothing_to_avoid_or_naming_its_nodes_gets_its_own_labels():
    assert keeper_selectors({"pool": "a"}, {}, NODES, island_nodes=set()) == [{"pool": "a"}]
    pinned = {"pool": "a", NODE_ID_LABEL: "in(n1)"}
    assert keeper_selectors(pinned, {}, NODES, island_nodes={"n1"}) == [pinned]


def test_a_resource_pool_lists_its_nodes_without_islands_then_all_its_nodes_then_anywhere():
    assert pool_nodes({"pool_a": 1.0}, NODES) == ["n1", "n2"]
    got = keeper_selectors({}, {"pool_a": 1.0}, NODES, island_nodes={"n1", "n3"})
    assert got == [{NODE_ID_LABEL: "in(n2)"}, {NODE_ID_LABEL: "in(n1,n2)"}, {}]


def test_a_resource_pool_whose_every_node_hosts_islands_falls_back_to_them():
    got = keeper_selectors({}, {"pool_b": 1.0}, NODES, island_nodes={"n3"})
    assert got == [{NODE_ID_LABEL: "in(n3)"}, {}]


def test_a_resource_pool_with_no_node_left_goes_anywhere():
    assert keeper_selectors({}, {"pool_c": 1.0}, NODES, island_nodes=set()) == [{}]


def test_an_unpinned_pool_avoids_the_islands_nodes_among_all_nodes():
    got = keeper_selectors({}, {}, NODES, island_nodes={"n1", "n2", "n3"})
    assert got == [{NODE_ID_LABEL: "in(n4)"}, {NODE_ID_LABEL: "in(n1,n2,n3,n4)"}, {}]
    assert keeper_selectors({}, {}, {"n1": {}}, island_nodes={"n1"}) == [{NODE_ID_LABEL: "in(n1)"}, {}]


def test_selectors_match_node_labels_in_rays_four_forms():
    node = {"pool": "a", "region": "us-east", NODE_ID_LABEL: "n1"}
    assert matches(node, {}) and matches(node, {"pool": "a"}) and not matches(node, {"pool": "b"})
    assert matches(node, {"pool": "!b"}) and not matches(node, {"pool": "!a"})
    assert matches(node, {"pool": "in(b, a)"}) and not matches(node, {"pool": "in(b,c)"})
    assert matches(node, {NODE_ID_LABEL: "!in(n2,n3)"}) and not matches(node, {NODE_ID_LABEL: "!in(n1,n2)"})
    assert not matches(node, {"zone": "z1"}) and matches(node, {"zone": "!z1"}), "a missing label is not any value"


def test_a_keeper_moves_only_when_a_node_better_than_its_own_is_alive():
    a1, a2 = {"pool": "a", NODE_ID_LABEL: "a1"}, {"pool": "a", NODE_ID_LABEL: "a2"}
    other_pool = {"pool": "b", "region": "us-east", NODE_ID_LABEL: "b1"}
    # An island was restarted onto the keeper's node a1: a2 is free of islands, so move; alone, stay.
    sel = keeper_selectors({"pool": "a"}, {}, {}, island_nodes={"a1"})
    assert should_move(sel, a1, [a2]) and not should_move(sel, a1, [])
    assert not should_move(sel, a2, [a1]), "already on the best kind of node"
    # Both pool nodes host islands: nothing better than where it is.
    sel = keeper_selectors({"pool": "a"}, {}, {}, island_nodes={"a1", "a2"})
    assert not should_move(sel, a1, [a2])
    # A pool labelled by region, sharing its island's node: the region's other node is better.
    a1r = {**a1, "region": "us-east"}
    sel = keeper_selectors({"pool": "a", "region": "us-east"}, {}, {}, island_nodes={"a1"})
    assert should_move(sel, a1r, [other_pool]) and not should_move(sel, other_pool, [a1r])

