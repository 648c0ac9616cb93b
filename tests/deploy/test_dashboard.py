"""The Grafana dashboard of the run's metrics (orchestrator/grafana/diloco_dashboard.json), without Ray running:
valid dashboard JSON laid out without overlaps, every query names only metrics RunMetrics defines and every
RunMetrics metric is on a panel, the queries parse as PromQL (where promtool is installed), and `diloco dashboard
install` finds the folder that Ray 2.60's own Grafana provisioning code writes. The live run's export is checked
against the same names in tests/deploy/test_jobs.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from orchestrator.cli.dashboard import default_ray_temp_dir
from orchestrator.cli.main import main as diloco
from orchestrator.deploy.dashboard import (
    DASHBOARD_PATH,
    dashboard_exprs,
    dashboard_metric_names,
    exported_names,
    load_dashboard,
    panels,
    run_metric_definitions,
    session_dashboards_dir,
)

ROOT = Path(__file__).resolve().parents[2]


def _data_panels(dashboard: dict) -> list[dict]:
    return [p for p in panels(dashboard) if p["type"] != "row"]


def test_the_dashboard_is_grafana_dashboard_json():
    dash = load_dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["title"] and dash["uid"] and len(dash["uid"]) <= 40
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    # Grafana's grid is 24 wide; two panels must not share a cell.
    cells: dict[tuple[int, int], str] = {}
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    for p in _data_panels(dash):
        assert p["datasource"] == "${datasource}", p["title"]  # as Ray's own dashboards reference it
        assert p["targets"] and all(t["expr"].strip() and t["refId"] for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        assert p["title"] and p["description"], p["id"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run_id = variables["run_id"]
    assert run_id["type"] == "query" and run_id["datasource"] == "${datasource}"
    assert run_id["query"]["query"] == run_id["definition"] == "label_values(ray_diloco_tokens_processed, run_id)"
    # One dashboard serves many runs: every panel query selects the chosen run.
    for p in _data_panels(dash):
        for t in p["targets"]:
            selectors = re.findall(r"\bray_diloco_[a-z_]+(\{[^}]*\})?", t["expr"])
            assert selectors and all('run_id=~"$run_id"' in s for s in selectors), t["expr"]


def test_every_query_names_a_runmetrics_metric_and_every_metric_is_on_a_panel():
    definitions = run_metric_definitions()
    assert definitions["diloco_rounds"] == "Counter" and definitions["diloco_staleness"] == "Histogram"
    exported = {n for name, kind in definitions.items() for n in exported_names(name, kind)}
    named = dashboard_metric_names()
    assert named and named <= exported, sorted(named - exported)
    missing = [name for name, kind in definitions.items() if not exported_names(name, kind) & named]
    assert not missing, f"metrics on no panel: {missing}"
    # Histograms are read through their buckets (quantiles) and sum/count (means).
    for name in (n for n, k in definitions.items() if k == "Histogram"):
        assert exported_names(name, "Histogram") <= named, name
    # The definitions read from the source are the table of docs/metrics.md, "Every metric".
    table = re.findall(r"^\| `(diloco_[a-z_]+)` \| (counter|gauge|histogram) \|", (ROOT / "docs" / "metrics.md").read_text(), re.M)
    assert {n: k.capitalize() for n, k in table} == definitions


def test_names_are_exported_as_docs_metrics_md_says():
    assert exported_names("diloco_rounds", "Counter") == {"ray_diloco_rounds_total"}
    assert exported_names("diloco_goodput", "Gauge") == {"ray_diloco_goodput"}
    assert exported_names("diloco_staleness", "Histogram") == {
        "ray_diloco_staleness_bucket", "ray_diloco_staleness_sum", "ray_diloco_staleness_count"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus; Debian package prometheus) not installed")
def test_every_query_parses_as_promql(tmp_path):
    # Grafana substitutes its variables before Prometheus sees a query; promtool checks each as a recording rule.
    grafana_vars = {"$__rate_interval": "1m", "$__range": "30m", "$run_id": "run-1"}
    exprs = []
    for expr in dashboard_exprs():
        if expr.startswith("label_values("):  # Grafana's own function, not PromQL: its selector is
            expr = expr[len("label_values("):].rsplit(",", 1)[0]
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        exprs.append(expr)
    rules = {"groups": [{"name": "diloco_dashboard", "rules": [{"record": f"diloco:query{i}", "expr": e}
                                                               for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    got = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in got.stdout, got.stdout + got.stderr


def _ray_session(temp_dir: Path, monkeypatch, dashboard_output_dir: Path | None = None) -> Path:
    """A session as Ray 2.60's dashboard lays it out: its own MetricsHead._create_default_grafana_configs writes the
    Grafana files, with the paths MetricsHead.__init__ derives (no Ray started)."""
    from ray.dashboard.modules.metrics.metrics_head import MetricsHead

    session = temp_dir / "session_2026-01-01_00-00-00_000000_1"
    session.mkdir(parents=True)
    (temp_dir / "session_latest").symlink_to(session)
    grafana = session / "metrics" / "grafana"
    monkeypatch.delenv("RAY_PROMETHEUS_HEADERS", raising=False)
    head = SimpleNamespace(_grafana_config_output_path=str(grafana),
                           _grafana_session_latest_config_output_path=str(temp_dir / "session_latest" / "metrics" / "grafana"),
                           _grafana_dashboard_output_dir=str(dashboard_output_dir or grafana / "dashboards"),
                           _prometheus_name="Prometheus", _dashboard_uids={})
    MetricsHead._create_default_grafana_configs(head)  # type: ignore[arg-type]  # only the attributes it reads
    return session


def test_install_finds_the_folder_rays_provisioning_reads(tmp_path, monkeypatch, capsys):
    temp_dir = tmp_path / "ray"
    session = _ray_session(temp_dir, monkeypatch)
    dashboards = session / "metrics" / "grafana" / "dashboards"
    assert (dashboards / "default_grafana_dashboard.json").is_file()  # Ray's own, beside which ours goes
    ini = (session / "metrics" / "grafana" / "grafana.ini").read_text()
    assert f"provisioning = {temp_dir / 'session_latest' / 'metrics' / 'grafana' / 'provisioning'}" in ini
    assert session_dashboards_dir(temp_dir) == dashboards
    assert diloco(["dashboard", "install", "--temp-dir", str(temp_dir)]) == 0
    assert json.loads((dashboards / "diloco_dashboard.json").read_text()) == load_dashboard()
    assert capsys.readouterr().out.strip() == f'installed {dashboards / "diloco_dashboard.json"}: Grafana lists it as "Decoupled DiLoCo"'
    # With $RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR Ray's provider reads that folder: so does install.
    elsewhere = tmp_path / "custom-dashboards"
    _ray_session(tmp_path / "ray2", monkeypatch, dashboard_output_dir=elsewhere)
    assert diloco(["dashboard", "install", "--temp-dir", str(tmp_path / "ray2")]) == 0
    assert (elsewhere / "diloco_dashboard.json").read_bytes() == DASHBOARD_PATH.read_bytes()


def test_install_copies_into_a_given_folder(tmp_path, capsys):
    assert diloco(["dashboard", "install", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / "diloco_dashboard.json").read_bytes() == DASHBOARD_PATH.read_bytes()
    assert capsys.readouterr().out.startswith(f"installed {tmp_path / 'diloco_dashboard.json'}")


@pytest.mark.parametrize("args, message", [
    (["--dir", "{tmp}/missing"], "no folder {tmp}/missing"),
    (["--dir", "{tmp}/a-file"], "{tmp}/a-file is not a folder"),
    (["--temp-dir", "{tmp}"], "no Ray session at {tmp}/session_latest: start Ray on this node"),
    (["--temp-dir", "{tmp}/no-provisioning"], "the Ray session at {tmp}/no-provisioning/session_x has no Grafana provisioning"),
    (["--temp-dir", "{tmp}/bad-provisioning"], "cannot read the dashboard folder from"),
])
def test_install_refuses_bad_input_in_one_line(tmp_path, capsys, args, message):
    (tmp_path / "a-file").write_text("")
    for name, provider in (("no-provisioning", None), ("bad-provisioning", "providers: [{name: Ray}]\n")):
        session = tmp_path / name / "session_x"
        session.mkdir(parents=True)
        (tmp_path / name / "session_latest").symlink_to(session)
        if provider is not None:
            (session / "metrics/grafana/provisioning/dashboards").mkdir(parents=True)
            (session / "metrics/grafana/provisioning/dashboards/default.yml").write_text(provider)
    assert diloco(["dashboard", "install", *[a.format(tmp=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"diloco dashboard install: {message.format(tmp=tmp_path)}") and "\n" not in err, err
    assert not list(tmp_path.rglob("diloco_dashboard.json"))


def test_install_needs_one_place_and_defaults_to_rays_temp_dir(monkeypatch):
    from ray._common.utils import get_default_ray_temp_dir

    for env in ({}, {"TMPDIR": "/scratch"}, {"RAY_TMPDIR": "/data/rt", "TMPDIR": "/scratch"}):
        for key in ("RAY_TMPDIR", "TMPDIR"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert str(default_ray_temp_dir()) == get_default_ray_temp_dir(), env
    with pytest.raises(SystemExit):  # argparse: --dir and --temp-dir are either-or
        diloco(["dashboard", "install", "--dir", "/x", "--temp-dir", "/y"])


def test_the_dashboard_ships_as_package_data():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"grafana/*.json"' in pyproject and DASHBOARD_PATH.parent.name == "grafana"
    got = subprocess.run([sys.executable, "-m", "orchestrator.cli", "dashboard", "install", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and "--temp-dir" in got.stdout, got.stderr
