"""The Grafana dashboard of a run's `ray_diloco_*` metrics, and where Ray's Grafana provisioning picks it up.

The dashboard is `orchestrator/grafana/diloco_dashboard.json` (package data). Ray 2.60's dashboard process
(ray/dashboard/modules/metrics/metrics_head.py) writes, each time it starts, `<session>/metrics/grafana/`: a
`grafana.ini` whose provisioning path is `<temp dir>/session_latest/metrics/grafana/provisioning`, a dashboard
provider `provisioning/dashboards/default.yml` that reads every JSON in `grafana/dashboards/` (or
$RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR), and its own dashboards there. `install_dashboard` copies ours into the
folder that provider names. docs/metrics.md ("Grafana") says how to see it.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import yaml

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "grafana" / "diloco_dashboard.json"
METRICS_SOURCE = Path(__file__).resolve().parents[1] / "run" / "metrics.py"
# The provider file Ray writes, relative to a session directory (metrics_head.py _create_default_grafana_configs).
PROVISIONING = Path("metrics") / "grafana" / "provisioning" / "dashboards" / "default.yml"
METRIC_NAME = re.compile(r"\bray_diloco_[a-z_]+")
# What Prometheus names a metric of each `ray.util.metrics` type (ray_ prefix; docs/metrics.md).
EXPORTED_SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


class DashboardError(Exception):
    """A one-line reason why the dashboard cannot be installed."""


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict:
    """The dashboard JSON as a dict."""
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included (a collapsed row holds its panels inside it)."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(dashboard: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets' and template variables' queries."""
    dashboard = load_dashboard() if dashboard is None else dashboard
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def dashboard_metric_names(dashboard: dict | None = None) -> set[str]:
    """The exported metric names (`ray_diloco_...`) that the dashboard's queries name."""
    return {name for expr in dashboard_exprs(dashboard) for name in METRIC_NAME.findall(expr)}


def run_metric_definitions(source: Path = METRICS_SOURCE) -> dict[str, str]:
    """Metric name as recorded -> its type (Counter, Gauge, Histogram), read from RunMetrics.__init__'s source.

    Read from the source, not by building RunMetrics: building registers metrics with Ray.
    """
    tree = ast.parse(source.read_text(), filename=str(source))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunMetrics")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    found = {}
    for node in ast.walk(init):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in EXPORTED_SUFFIXES
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found[node.args[0].value] = node.func.id
    return found


def exported_names(name: str, kind: str) -> set[str]:
    """The names Prometheus scrapes for one metric as recorded: `diloco_rounds` (Counter) -> ray_diloco_rounds_total."""
    return {f"ray_{name}{suffix}" for suffix in EXPORTED_SUFFIXES[kind]}


def session_dashboards_dir(temp_dir: Path) -> Path:
    """The folder that the Ray session under `temp_dir` (`<temp_dir>/session_latest`) has Grafana read dashboards
    from: the `path` of the dashboard provider Ray wrote. Raises DashboardError when there is none."""
    session = temp_dir / "session_latest"
    provider = session / PROVISIONING
    if not session.exists():
        raise DashboardError(f"no Ray session at {session}: start Ray on this node (ray start --head "
                             "--metrics-export-port=8080), or pass --temp-dir or --dir")
    if not provider.is_file():
        raise DashboardError(f"the Ray session at {session.resolve()} has no Grafana provisioning ({PROVISIONING}): "
                             "its dashboard did not start (ray start --include-dashboard true) or writes elsewhere "
                             "($RAY_METRICS_OUTPUT_ROOT); pass --dir")
    try:
        providers = yaml.safe_load(provider.read_text())["providers"]
        return Path(next(p["options"]["path"] for p in providers if p.get("type") == "file"))
    except (yaml.YAMLError, KeyError, TypeError, StopIteration) as err:
        raise DashboardError(f"cannot read the dashboard folder from {provider} ({type(err).__name__}); pass --dir") from err


def install_dashboard(target_dir: Path, source: Path = DASHBOARD_PATH) -> Path:
    """Copy the dashboard JSON into `target_dir` (an existing folder); returns the file written.

    A missing folder is refused, not created: a mistyped path would otherwise leave the dashboard where no
    Grafana looks.
    """
    if not target_dir.exists():
        raise DashboardError(f"no folder {target_dir}")
    if not target_dir.is_dir():
        raise DashboardError(f"{target_dir} is not a folder")
    target = target_dir / source.name
    try:
        shutil.copyfile(source, target)
    except OSError as err:
        raise DashboardError(f"cannot write {target}: {err.strerror or err}") from err
    return target
