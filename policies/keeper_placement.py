"""Where a pool's progress keeper goes: inside its pool, on a node that hosts none of its islands.

A keeper (orchestrator/actors/keeper.py) holds the islands' unsubmitted progress so that a dead island's work
is merged instead of lost (policies/salvage.py). On a node that also hosts one of those islands, losing
that node loses the island and its snapshot together, which is exactly the failure salvage is for. So
the keeper is steered, in order of preference:

1. to a node of its pool that hosts none of the pool's islands (nor its warm spares);
2. when the pool selects its nodes by a `region` label, to another node of that region that hosts none
   of them (another pool's node: a pool that is one node per region, as in configs/multi-region.yaml,
   has no island-free node of its own);
3. to any node of its pool (salvage then covers every failure but that of the keeper's own node);
4. for a pool pinned only by custom resources or not pinned at all, to any node (the pool's nodes are
   all gone; the keeper still runs, as before this rule).

Snapshots stay inside the pool or its region (they are a model's size every few steps and must not
cross the WAN), so a node elsewhere is only the last resort for pools that have no labels to keep it in.

Ray expresses the preferences as label selectors: the first is the actor's `label_selector`, the rest
its `fallback_strategy`, tried in order (docs/architecture.md section 4). A pool with labels is matched by its
own selector plus `ray.io/node-id: !in(...)`, so Ray alone interprets its label syntax when placing; a
pool pinned by custom resources is matched by listing its nodes, found from their resources. `matches`
re-implements Ray's four selector forms only to compare nodes when deciding whether to move a keeper.
The choice is made when the keeper starts, with the islands placed so far. Islands restart and nodes
come and go afterwards, so the health monitor also checks now and then whether a node of a more
preferred kind than the keeper's own exists (`should_move`) and, if so, moves the keeper there with
its snapshots (orchestrator/actors/keepers.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["NODE_ID_LABEL", "REGION_LABEL", "keeper_selectors", "matches", "pool_nodes", "should_move"]

NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node
REGION_LABEL = "region"  # the node label pools name their region by (docs/architecture.md section 4, cluster.yaml)


def pool_nodes(resources: Mapping[str, float], nodes: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The alive nodes (id -> total resources) that have every custom resource a pool's bundles ask for, sorted."""
    return sorted(n for n, have in nodes.items() if all(have.get(k, 0.0) >= v for k, v in resources.items()))


def _node_in(ids: Iterable[str], negate: bool = False) -> str:
    return f"{'!' if negate else ''}in({','.join(sorted(ids))})"


def _unique(selectors: list[dict[str, str]]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for sel in selectors:
        if sel not in out:
            out.append(sel)
    return out


def keeper_selectors(labels: Mapping[str, str], resources: Mapping[str, float],
                     nodes: Mapping[str, Mapping[str, float]], island_nodes: Iterable[str]) -> list[dict[str, str]]:
    """Label selectors for a pool's keeper, most preferred first (at least one; never an unsatisfiable last one
    for a pool that has labels, whose keeper must stay in the pool).

    `labels`, `resources`: the pool's (PoolConfig). `nodes`: the cluster's alive nodes, id -> total resources
    (only read for a pool without labels). `island_nodes`: the nodes hosting the pool's islands and spares now.
    """
    avoid = set(island_nodes)
    away = {NODE_ID_LABEL: _node_in(avoid, negate=True)} if avoid else {}
    region = dict(labels).get(REGION_LABEL, "")
    plain = bool(region) and not region.startswith("!") and "(" not in region  # one region, not a selector
    in_region = [{REGION_LABEL: region, **away}] if away and plain else []
    if labels:
        base = dict(labels)
        # A pool that names its nodes itself keeps that pin: no step of its own away from its islands.
        own = [] if NODE_ID_LABEL in base else [{**base, **away}]
        return _unique(own + in_region + [base])
    members = pool_nodes(resources, nodes)
    preferred = [n for n in members if n not in avoid]
    out: list[dict[str, str]] = []
    if preferred:
        out.append({NODE_ID_LABEL: _node_in(preferred)})
    if members and len(preferred) < len(members):
        out.append({NODE_ID_LABEL: _node_in(members)})
    out.append({})  # anywhere: the pool has no labels to keep it in, and a keeper that runs beats none
    return out


def _value_matches(have: str | None, want: str) -> bool:
    """One label against one selector value, in the four forms Ray accepts: v, !v, in(a,b), !in(a,b)."""
    negate = want.startswith("!")
    body = want[1:] if negate else want
    if body.startswith("in(") and body.endswith(")"):
        hit = have is not None and have in [v.strip() for v in body[3:-1].split(",")]
    else:
        hit = have == body
    return hit != negate


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether a node with `labels` (its `ray.io/node-id` included) satisfies a label selector."""
    return all(_value_matches(labels.get(key), want) for key, want in selector.items())


def should_move(selectors: list[dict[str, str]], current: Mapping[str, str],
                candidates: Iterable[Mapping[str, str]]) -> bool:
    """Whether some alive node (`candidates`, each a node's labels with its node id) satisfies an earlier
    selector than the first one the keeper's current node satisfies: a better place exists."""
    def rank(labels: Mapping[str, str]) -> int:
        return next((i for i, sel in enumerate(selectors) if matches(labels, sel)), len(selectors))

    here = rank(current)
    return any(rank(node) < here for node in candidates)
