"""Does a cluster.yaml fit a training config? Pools -> node types, plus the cluster's safety settings.

`ray up` validates a cluster.yaml against Ray's schema, but it cannot know which node types a
training config needs. This module can: for every pool it finds the node types whose `labels`
satisfy the pool's label selector and whose declared `resources` hold a worker bundle of the pool
(orchestrator.actors.placement.island_bundle; an island is `workers_per_island` such bundles, PACKed onto
as few nodes of the pool as possible), and reports each pool that has none, in one line that names
the pool and the fix. `safety_problems` checks the security defaults (token
authentication on every `ray start`, no token in the file, dashboard and Jobs API bound to localhost
unless opted in); `region_problems` checks that only node types of the head's region are autoscaled.

Plain dicts and a RunConfig in, lists of one-line strings out: no cluster, no cloud calls. Run every
check with (orchestrator/cli/cluster.py)

    diloco check-cluster --cluster cluster.yaml --config configs/multi-region.yaml
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import yaml

from orchestrator.actors.placement import format_mapping, label_selector_matches, worker_bundle
from orchestrator.config import ConfigError, PoolConfig, RunConfig

LOCAL_DASHBOARD_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_TOKEN_PATH = "~/.ray/auth_token"  # where Ray reads the token when RAY_AUTH_TOKEN(_PATH) is unset


def load_cluster_yaml(path: str | Path) -> dict[str, Any]:
    """Read a cluster.yaml into a dict, raising ConfigError with a one-line message when it cannot."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cluster file {str(p)!r} does not exist; pass the cluster.yaml you give to `ray up`")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"cluster file {str(p)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {str(p)!r} must hold a mapping at the top level")
    return data


def ray_schema_problems(cluster_yaml: dict[str, Any]) -> list[str]:
    """What Ray's own checks say (the ones `ray up` runs before any cloud call): defaults merged by
    `prepare_config`, then `validate_config` (ray-schema.json plus head/min_workers rules). One line."""
    from ray.autoscaler._private.util import prepare_config, validate_config  # Ray's cluster launcher

    try:
        validate_config(prepare_config(copy.deepcopy(cluster_yaml)))
    except Exception as err:  # noqa: BLE001 - jsonschema.ValidationError, ValueError, KeyError: all reported
        where = "/".join(str(p) for p in getattr(err, "absolute_path", ()))
        msg = getattr(err, "message", None) or str(err)
        return [f"cluster.yaml fails Ray's validation{f' at {where}' if where else ''}: {msg.splitlines()[0]}"]
    return []


# ------------------------------------------------------------------------------------ pools -> nodes

def island_demand(pool: PoolConfig) -> dict[str, float]:
    """Resources one whole island of `pool` reserves: `workers_per_island` worker bundles."""
    return {k: v * pool.workers_per_island for k, v in worker_bundle(pool).items()}


def fits_per_node(resources: dict[str, float], demand: dict[str, float]) -> int:
    """How many copies of `demand` (a bundle or an island) fit on one node with `resources` (undeclared = 0)."""
    fits = min((math.floor(resources.get(k, 0) / need + 1e-9) for k, need in demand.items()), default=0)
    return max(0, int(fits))


def _node_types(cluster_yaml: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return cluster_yaml.get("available_node_types") or {}


def joined_by_hand(cluster_yaml: dict[str, Any], node_type: str) -> bool:
    """True for a worker node type the autoscaler never launches (max_workers: 0): its machines are
    started by hand (`ray start --address=...`), e.g. because they are in another region."""
    if node_type == cluster_yaml.get("head_node_type"):
        return False
    return _node_types(cluster_yaml)[node_type].get("max_workers", cluster_yaml.get("max_workers", 2)) == 0


def _max_nodes(cluster_yaml: dict[str, Any], node_type: str) -> int:
    if node_type == cluster_yaml.get("head_node_type"):
        return 1
    return int(_node_types(cluster_yaml)[node_type].get("max_workers", cluster_yaml.get("max_workers", 2)))


def pool_node_types(cluster_yaml: dict[str, Any], pool: PoolConfig) -> list[str]:
    """The node types of `cluster_yaml` that can host workers of `pool`: labels match the pool's
    selector and declared resources hold at least one worker bundle."""
    bundle = worker_bundle(pool)
    return [
        name for name, t in _node_types(cluster_yaml).items()
        if label_selector_matches(pool.labels, t.get("labels") or {})
        and fits_per_node(t.get("resources") or {}, bundle) >= 1
    ]


def _pool_problem(cluster_yaml: dict[str, Any], pool: PoolConfig) -> str | None:
    types = _node_types(cluster_yaml)
    demand = worker_bundle(pool)
    head = f"pool {pool.name!r}"
    by_label = [n for n, t in types.items() if label_selector_matches(pool.labels, t.get("labels") or {})]
    if not by_label:
        return (f"{head}: no node type of cluster.yaml has labels matching {format_mapping(pool.labels)}; "
                f"add them to a node type's labels: or fix the pool's labels")
    with_keys = [n for n in by_label if all(k in (types[n].get("resources") or {}) for k in demand)]
    if not with_keys:
        n = by_label[0]
        missing = sorted(set(demand) - set(types[n].get("resources") or {}))
        return (f"{head}: node type {n} matches its labels but does not declare resource(s) {', '.join(missing)}; "
                f"add them to its resources: (the autoscaler and this check only know declared resources)")
    fitting = [n for n in with_keys if fits_per_node(types[n]["resources"], demand) >= 1]
    if not fitting:
        n = with_keys[0]
        have = types[n]["resources"]
        short = {k: need - have.get(k, 0) for k, need in demand.items() if have.get(k, 0) < need}
        return (f"{head}: one worker bundle needs {format_mapping(demand, ' ')} on one node but node type {n} has "
                f"{format_mapping({k: have.get(k, 0) for k in demand}, ' ')}, short {format_mapping(short, ' ')}; "
                f"lower gpus_per_worker or cpus_per_island, or use a bigger machine")
    regions = {(types[n].get("labels") or {}).get("region") for n in fitting}
    if None not in regions and pool.region not in regions:
        return (f"{head}: region is {pool.region!r} but its node type(s) {', '.join(fitting)} are labelled "
                f"region={'/'.join(sorted(regions))}; make pool.region agree (reports and the network model use it)")
    if not any(joined_by_hand(cluster_yaml, n) for n in fitting):
        need = pool.islands * pool.workers_per_island
        room = sum(_max_nodes(cluster_yaml, n) * fits_per_node(types[n]["resources"], demand) for n in fitting)
        if room < need:
            return (f"{head}: {pool.islands} islands x {pool.workers_per_island} workers need {need} worker bundles "
                    f"but node type(s) {', '.join(fitting)} hold at most {room} (max_workers x bundles per node); "
                    f"raise max_workers")
    return None


def unmatched_pools(cluster_yaml: dict[str, Any], cfg: RunConfig) -> list[str]:
    """One line per pool of `cfg` that no node type of `cluster_yaml` can host, naming the pool, what is
    missing and the fix. Empty when every pool fits.

    Checked per pool: a node type whose labels satisfy the pool's labels (as a Ray label selector),
    that declares every resource a worker bundle asks for, with room for one bundle on one node, in
    the pool's region (when the node type has a region label), and, when all its node types are
    autoscaled, with max_workers x bundles per node >= islands x workers_per_island (hand-joined
    node types, max_workers 0, have no count to check). Whether a whole island fits on one node is
    not required (placement PACKs an island over nodes of its pool when it must); the shipped config
    is sized so that it does. Pools sharing a node type are checked one at a time.
    """
    return [msg for pool in cfg.pools if (msg := _pool_problem(cluster_yaml, pool)) is not None]


# ------------------------------------------------------------------------------------ safety

def _ray_starts(cluster_yaml: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for section in ("head_start_ray_commands", "worker_start_ray_commands"):
        out += [(section, str(cmd)) for cmd in cluster_yaml.get(section) or [] if re.search(r"\bray start\b", str(cmd))]
    return out


def _strings(node: Any):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _home(path: str) -> str:
    return re.sub(r"^(\$HOME|\$\{HOME\}|~)/", "~/", path.strip("'\""))


def safety_problems(cluster_yaml: dict[str, Any], *, allow_public_dashboard: bool = False) -> list[str]:
    """One line per unsafe setting of `cluster_yaml`; empty when the security defaults hold.

    - every `ray start` (head and workers) runs with RAY_AUTH_MODE=token, and its token file
      (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) lies under a file_mounts target;
    - no literal RAY_AUTH_TOKEN value anywhere in the file (it would be committed with it);
    - the head's dashboard (which serves the Jobs API, i.e. runs code) binds to localhost, unless
      `allow_public_dashboard` (the user's explicit opt-in, docs/cluster.md).
    """
    problems = []
    starts = _ray_starts(cluster_yaml)
    head_starts = [cmd for section, cmd in starts if section == "head_start_ray_commands" and "--head" in cmd]
    if not head_starts:
        problems.append("head_start_ray_commands has no `ray start --head`; the checks below cannot see the head")
    mounts = [_home(str(k)).rstrip("/") for k in (cluster_yaml.get("file_mounts") or {})]
    for section, cmd in starts:
        modes = re.findall(r"RAY_AUTH_MODE=([\w-]+)", cmd)
        if not modes or any(m != "token" for m in modes):
            problems.append(f"{section}: `ray start` runs without RAY_AUTH_MODE=token; prefix it with "
                            f"`export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=...;` (without a token anyone "
                            f"who reaches the cluster's ports can run code on it)")
            continue
        paths = re.findall(r"RAY_AUTH_TOKEN_PATH=(\S+?)(?:;|\s|$)", cmd)
        token_path = _home(paths[-1]) if paths else DEFAULT_TOKEN_PATH
        if "RAY_AUTH_TOKEN=" not in cmd and not any(token_path == m or token_path.startswith(m + "/") for m in mounts):
            problems.append(f"{section}: token file {token_path} is not under any file_mounts target, so the "
                            f"nodes have no token; mount its directory (docs/cluster.md, 'Token')")
    if any(re.search(r"RAY_AUTH_TOKEN=(?![\"']?\$)\S", s) for s in _strings(cluster_yaml)):
        problems.append("cluster.yaml holds a literal RAY_AUTH_TOKEN value; keep the token in a mounted file "
                        "(RAY_AUTH_TOKEN_PATH) so it is never committed")
    for cmd in head_starts:
        hosts = re.findall(r"--dashboard-host[= ]+['\"]?([^\s'\";]+)", cmd)
        exposed = [h for h in hosts if h not in LOCAL_DASHBOARD_HOSTS]
        if exposed and not allow_public_dashboard:
            problems.append(f"head_start_ray_commands: --dashboard-host={exposed[-1]} exposes the dashboard and Jobs "
                            f"API (remote code execution) beyond the head; use 127.0.0.1 and `ray dashboard "
                            f"cluster.yaml`, or opt in explicitly (--allow-public-dashboard, docs/cluster.md)")
    return problems


def region_problems(cluster_yaml: dict[str, Any]) -> list[str]:
    """One line per autoscaled node type labelled with a region other than the head's: Ray's autoscaler
    launches every node in the provider's zone, so such a node would sit in the wrong region."""
    types = _node_types(cluster_yaml)
    head = cluster_yaml.get("head_node_type")
    head_region = (types.get(head, {}).get("labels") or {}).get("region")
    if head_region is None:
        return []
    problems = []
    for name, t in types.items():
        region = (t.get("labels") or {}).get("region")
        if name != head and region not in (None, head_region) and not joined_by_hand(cluster_yaml, name):
            problems.append(f"node type {name} is labelled region={region} but the autoscaler would launch it in the "
                            f"head's region ({head_region}); set its max_workers: 0 and join it by hand (docs/cluster.md)")
    return problems


def check(cluster_yaml: dict[str, Any], cfg: RunConfig, *, allow_public_dashboard: bool = False) -> list[str]:
    """Every check of this module: Ray's validation, region, safety, then pools."""
    return (ray_schema_problems(cluster_yaml) + region_problems(cluster_yaml)
            + safety_problems(cluster_yaml, allow_public_dashboard=allow_public_dashboard)
            + unmatched_pools(cluster_yaml, cfg))


def pool_placements(cluster_yaml: dict[str, Any], cfg: RunConfig) -> list[str]:
    """One line per pool of `cfg`: its islands' demand and the node types that can host them (for a
    config that passed `check`)."""
    lines = []
    for pool in cfg.pools:
        names = pool_node_types(cluster_yaml, pool)
        kinds = ", ".join(f"{n} ({'joined by hand' if joined_by_hand(cluster_yaml, n) else 'autoscaled'})" for n in names)
        lines.append(f"{pool.name}: {pool.islands} island(s) of {format_mapping(island_demand(pool), ' ')} -> {kinds}")
    return lines
