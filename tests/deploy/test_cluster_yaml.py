"""cluster.yaml for `ray up`: Ray's own validation, every pool of configs/multi-region.yaml placed on
a node type, the security defaults, and a matcher that can fail. Plain files and Ray's own checks;
no cluster is started and no cloud is called."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from orchestrator.cli.main import main as diloco
from orchestrator.config import build_config, load_config
from orchestrator.deploy.cluster_check import (
    fits_per_node,
    island_demand,
    joined_by_hand,
    label_selector_matches,
    load_cluster_yaml,
    pool_node_types,
    ray_schema_problems,
    region_problems,
    safety_problems,
    unmatched_pools,
)

ROOT = Path(__file__).resolve().parents[2]
MULTI_REGION = ROOT / "configs" / "multi-region.yaml"
REGIONS = {"us-east", "us-central", "us-west", "us-south"}  # the network emulation's wan-4-regions
# The smoke run of docs/cluster.md ("Smoke test"): the CPU node type, before paying for GPUs.
SMOKE_OVERRIDES = [
    "pools=[{name: smoke, islands: 2, labels: {pool: cpu, region: us-central}, "
    "resources: {pool_us_central_cpu: 1}, cpus_per_island: 4, region: us-central}]",
    "outer.min_quorum=1", "model.preset=tiny", "run.token_budget=3000000",
]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return load_cluster_yaml(ROOT / "cluster.yaml")


@pytest.fixture(scope="module")
def cfg():
    return load_config(MULTI_REGION)


def _with_pool(**pool) -> object:
    """configs/multi-region.yaml plus one more pool."""
    data = yaml.safe_load(MULTI_REGION.read_text())
    data["pools"].append(pool)
    return build_config(data)


# ----------------------------------------------------------------------------- (a) Ray's validation

def test_cluster_yaml_passes_rays_own_validation(cluster):
    # What `ray up` runs before any cloud call (autoscaler/_private/commands.py, _bootstrap_config).
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)  # raises on any violation of ray-schema.json or the head/min_workers rules
    # The file as written, against the schema shipped in the installed Ray.
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)
    assert prepared["provider"]["type"] == "gcp"
    assert ray_schema_problems(cluster) == []
    for name, node in prepared["available_node_types"].items():
        assert {"pool", "region"} <= set(node["labels"]), f"{name} lacks pool/region labels"


def test_rays_validation_catches_a_broken_node_type(cluster):
    bad = copy.deepcopy(cluster)
    bad["available_node_types"]["us_east_h100"]["labels"]["gpus"] = 8  # label values must be strings
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(copy.deepcopy(bad)))
    [msg] = ray_schema_problems(bad)
    assert "available_node_types/us_east_h100/labels/gpus" in msg and "\n" not in msg


def test_setup_installs_the_pinned_torch_build_per_node_type(cluster):
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints-cpu.txt").read_text(), re.M).group(1)
    prepared = prepare_config(copy.deepcopy(cluster))
    for name, node in prepared["available_node_types"].items():
        if name == prepared["head_node_type"]:
            cmds = prepared["head_setup_commands"]
        else:
            cmds = node.get("worker_setup_commands") or prepared["worker_setup_commands"]
        text = "\n".join(cmds)
        assert f"torch=={pin}" in text, f"{name}: torch not pinned to constraints-cpu.txt's {pin}"
        if node["resources"].get("GPU"):
            assert "whl/cpu" not in text and "constraints-cpu.txt" not in text, name
            assert "torch.cuda.is_available()" in text, f"{name}: a GPU node must fail setup without CUDA"
        else:
            assert "--index-url https://download.pytorch.org/whl/cpu" in text, name
            assert "pip install -q -c constraints-cpu.txt -e ." in text, name
    assert prepared["file_mounts"]["~/decoupled-diloco"] == "."


# ----------------------------------------------------------------------------- (b) pools -> node types

def test_multi_region_config_spans_four_regions_and_two_generations(cfg):
    assert cfg.mode == "decoupled"
    assert {(p.region, p.accelerator) for p in cfg.pools} == {(r, a) for r in REGIONS for a in ("H100", "A100")}
    assert "network" not in yaml.safe_load(MULTI_REGION.read_text())


def test_every_pool_lands_on_one_node_type_of_its_region(cluster, cfg):
    assert unmatched_pools(cluster, cfg) == []
    for pool in cfg.pools:
        [name] = pool_node_types(cluster, pool)
        node = cluster["available_node_types"][name]
        assert node["labels"]["region"] == pool.region
        # One island fills one node's GPUs exactly (NCCL inside the node; none idle, none missing) and fits its CPUs.
        assert node["resources"]["GPU"] == pool.workers_per_island * pool.gpus_per_worker
        assert fits_per_node(node["resources"], island_demand(pool)) == 1
        # Only the head's region is autoscaled; the other regions join by hand.
        assert joined_by_hand(cluster, name) == (pool.region != "us-central")


def test_cpu_smoke_pool_lands_on_the_cpu_node_type(cluster):
    smoke = load_config(MULTI_REGION, SMOKE_OVERRIDES)
    assert unmatched_pools(cluster, smoke) == []
    assert pool_node_types(cluster, smoke.pools[0]) == ["us_central_cpu"]


def test_head_hosts_the_outer_optimizer_in_us_central_and_only_its_region_autoscales(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["labels"]["region"] == "us-central" and cluster["provider"]["region"] == "us-central1"
    assert region_problems(cluster) == []
    moved = copy.deepcopy(cluster)
    moved["available_node_types"]["us_west_h100"]["max_workers"] = 2
    [msg] = region_problems(moved)
    assert msg.startswith("node type us_west_h100 is labelled region=us-west") and "max_workers: 0" in msg


# ----------------------------------------------------------------------------- (c) safety

def test_security_defaults_hold(cluster):
    assert safety_problems(cluster) == []
    starts = [c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token" in c for c in starts)
    assert "--dashboard-host=127.0.0.1" in " ".join(cluster["head_start_ray_commands"])


def _edit_head(c, old, new):
    c["head_start_ray_commands"] = [s.replace(old, new) for s in c["head_start_ray_commands"]]


def _edit_workers(c, old, new):
    c["worker_start_ray_commands"] = [s.replace(old, new) for s in c["worker_start_ray_commands"]]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: _edit_head(c, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"),
         "head_start_ray_commands: --dashboard-host=0.0.0.0 exposes the dashboard and Jobs API"),
        (lambda c: _edit_workers(c, "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled"),
         "worker_start_ray_commands: `ray start` runs without RAY_AUTH_MODE=token"),
        (lambda c: c["file_mounts"].pop("~/.diloco/ray-token"),
         "token file ~/.diloco/ray-token/auth_token is not under any file_mounts target"),
        (lambda c: c["setup_commands"].append("echo 'export RAY_AUTH_TOKEN=0123abcd' >> ~/.bashrc"),
         "holds a literal RAY_AUTH_TOKEN value"),
    ],
)
def test_unsafe_settings_are_reported_in_one_line(cluster, edit, expected):
    unsafe = copy.deepcopy(cluster)
    edit(unsafe)
    problems = safety_problems(unsafe)
    assert problems and any(expected in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_public_dashboard_is_accepted_only_when_opted_in(cluster):
    public = copy.deepcopy(cluster)
    _edit_head(public, "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
    assert safety_problems(public) != []
    assert safety_problems(public, allow_public_dashboard=True) == []


# ----------------------------------------------------------------------------- (d) the matcher fails

def test_a_pool_selecting_a_label_no_node_type_has_is_named_in_one_line(cluster):
    cfg = _with_pool(name="eu-west/v5p", labels={"pool": "v5p", "region": "eu-west"}, region="eu-west")
    [msg] = unmatched_pools(cluster, cfg)
    assert msg.startswith("pool 'eu-west/v5p': no node type of cluster.yaml has labels matching")
    assert "pool=v5p" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "pool, expected",
    [
        ({"name": "big", "labels": {"pool": "h100", "region": "us-east"}, "resources": {"pool_us_east_h100": 1},
          "region": "us-east", "workers_per_island": 2, "gpus_per_worker": 16, "cpus_per_island": 8},
         "pool 'big': one worker bundle needs {CPU 8, GPU 16, pool_us_east_h100 1} on one node but node type "
         "us_east_h100 has {CPU 208, GPU 8, pool_us_east_h100 8}, short {GPU 8}"),
        ({"name": "nvl", "labels": {"pool": "h100", "region": "us-east"}, "resources": {"nvlink_domain": 1},
          "region": "us-east"},
         "pool 'nvl': node type us_east_h100 matches its labels but does not declare resource(s) nvlink_domain"),
        ({"name": "misnamed", "labels": {"pool": "a100", "region": "us-west"}, "region": "us-east"},
         "pool 'misnamed': region is 'us-east' but its node type(s) us_west_a100 are labelled region=us-west"),
        ({"name": "crowded", "islands": 3, "labels": {"pool": "h100", "region": "us-central"},
          "workers_per_island": 8, "gpus_per_worker": 1, "cpus_per_island": 8, "region": "us-central"},
         "pool 'crowded': 3 islands x 8 workers need 24 worker bundles but node type(s) us_central_h100 hold "
         "at most 16"),
    ],
)
def test_pools_that_do_not_fit_say_why(cluster, pool, expected):
    [msg] = unmatched_pools(cluster, _with_pool(**pool))
    assert msg.startswith(expected), msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "selector, labels, matches",
    [
        ({"pool": "h100"}, {"pool": "h100", "region": "us-east"}, True),
        ({"pool": "h100", "region": "us-west"}, {"pool": "h100", "region": "us-east"}, False),
        ({"pool": "in(a100,h100)"}, {"pool": "h100"}, True),
        ({"pool": "!h100"}, {"pool": "a100"}, True),
        ({"pool": "!in(a100,h100)"}, {"pool": "h100"}, False),
        ({"region": "!us-east"}, {"pool": "cpu"}, True),  # a negated term matches a node without the key
        ({"pool": "h100"}, {}, False),
    ],
)
def test_label_selector_forms(selector, labels, matches):
    assert label_selector_matches(selector, labels) is matches


def test_cli_prints_the_mapping_or_one_line_per_problem(tmp_path, capsys):
    assert diloco(["check-cluster", "--cluster", str(ROOT / "cluster.yaml"), "--config", str(MULTI_REGION)]) == 0
    out = capsys.readouterr().out
    assert "us-east/h100: 1 island(s)" in out and "us_east_h100 (joined by hand)" in out and out.rstrip().splitlines()[-1].startswith("ok:")
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(MULTI_REGION.read_text())
    data["pools"][0]["labels"] = {"pool": "tpu"}
    bad.write_text(yaml.safe_dump(data))
    assert diloco(["check-cluster", "--cluster", str(ROOT / "cluster.yaml"), "--config", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cluster_check: pool 'us-central/h100': no node type of cluster.yaml has labels matching "
                   "{pool=tpu}; add them to a node type's labels: or fix the pool's labels"]
