"""`diloco report`: plots and report.md from a synthetic run directory (no Ray, no training)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from orchestrator.core.eventlog import EventLog
from orchestrator.run.report import STATE_COLORS, ReportError, _marks, render_markdown, timeline_intervals, write_report
from policies.goodput import TIMELINE_STATES

EMULATION = "EMULATION: pool speeds emulated by throttling on one machine (slow x1.6 ±10%)"
T0 = 1_700_000_000.0  # epoch seconds of the first timeline event
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def summary() -> dict:
    """The key set `Run._summary` writes (taken from a real run), with small hand-made values."""
    islands = [
        {"island": 0, "pool": "fast", "node": "n0", "incarnation": 2, "failures": 1, "restarts": 1,
         "state": "stopped", "steps": 40, "tokens": 81920},
        {"island": 1, "pool": "slow", "node": "n0", "incarnation": 1, "failures": 0, "restarts": 0,
         "state": "stopped", "steps": 25, "tokens": 51200},
    ]
    evals = [{"wall_s": w, "tokens_processed": t, "tokens_merged": m, "versions": [v, v], "eval_loss": loss,
              "eval_bits_per_byte": loss / 0.6931471805599453}
             for w, t, m, v, loss in [(0.3, 0, 0.0, 0, 4.9), (10.0, 50_000, 40_960.0, 2, 3.2), (20.0, 133_120, 110_000.0, 5, 2.8)]]
    return {
        "mode": "decoupled", "emulation": EMULATION, "eval_loss": 2.8, "eval_bits_per_byte": 2.8 / 0.6931471805599453,
        "unigram_bits_per_byte": 4.845, "tokens_processed": 133_120, "tokens_merged": 110_000.0,
        "tokens_refused": 0.0, "tokens_lost": 12_000.0, "tokens_in_flight": 11_120.0, "tokens_overwritten": 0.0,
        "fill_s": 2.5,
        "token_ledger": {"processed": [133_120], "merged": [110_000], "refused": [0], "in_flight": [11_120], "lost": [12_000]},
        "goodput": 0.625, "uptime": 0.9, "useful_s": 25.0, "allocated_s": 40.0,
        "time_by_state_s": {"starting": 4.5, "training": 32.0, "blocked": 0.0, "dead": 1.0, "restarting": 2.0,
                            "reintegrating": 1.0},
        "failures": 1, "restarts": 1, "faults_injected": 1, "faults_skipped": 0, "faults_planned": 2,
        "mean_time_to_detect_s": 0.05, "mean_time_to_rejoin_s": 4.0, "stopped_by": "token_budget",
        "salvaged_tokens": 8_192.0, "salvages": 1, "salvage_snapshot_s": 0.2, "salvage_snapshot_bytes": 3_000_000,
        "keeper_restarts": 2,
        "rounds": 6, "refusals": 0, "versions": [5, 5], "bytes_up": 2_000_000, "bytes_down": 6_000_000,
        "bytes_sent": 8_000_000, "wall_s": 20.5, "resumed": False, "corpus": "synthetic", "islands": islands,
        "evals": evals,
    }


# (seconds after T0, island, incarnation, state): island 0 fails at 8 s and rejoins as incarnation 2 at 12 s.
TIMELINE = [(0.0, 0, 1, "starting"), (0.0, 1, 1, "starting"), (2.0, 0, 1, "training"),
            (2.5, 1, 1, "training"), (8.0, 0, 1, "dead"), (9.0, 0, 2, "restarting"), (11.0, 0, 2, "reintegrating"),
            (12.0, 0, 2, "training"), (20.0, 0, 2, "stopped"), (20.0, 1, 1, "stopped")]


def make_run(root: Path, *, timeline: bool = True, with_summary: bool = True) -> Path:
    """A run directory as `diloco train` leaves it: events/ part files and summary.json."""
    run = root / "run"
    s = summary()
    log = EventLog(run)
    log.add("evals", s["evals"])
    log.add("islands", [{"island": 0, "incarnation": 1, "pool": "fast", "state": "dead", "steps": 15, "tokens": 30720},
                        {"island": 0, "incarnation": 2, "pool": "fast", "state": "stopped", "steps": 25, "tokens": 51200},
                        {"island": 1, "incarnation": 1, "pool": "slow", "state": "stopped", "steps": 25, "tokens": 51200}])
    if timeline:
        log.add("timeline", [{"at": T0 + t, "island": i, "incarnation": inc, "state": st} for t, i, inc, st in TIMELINE])
    log.add("faults", [{"island": 0, "incarnation": 1, "kind": "kill_island", "outcome": "fired", "at": T0 + 8.0, "run_s": 9.5}])
    log.flush()
    if with_summary:
        (run / "summary.json").write_text(json.dumps(s))
    return run


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """One full report, rendered once for the tests that read it (plotting is the slow part)."""
    run = make_run(tmp_path_factory.mktemp("full"))
    return run, write_report(run)


def test_report_writes_both_plots(report):
    run, paths = report
    assert set(paths) == {"loss", "timeline", "report"}
    assert all(p.parent == run / "report" for p in paths.values())
    assert_png(paths["loss"])
    assert_png(paths["timeline"])


def test_report_md_carries_emulation_goodput_islands_and_faults(report):
    md = report[1]["report"].read_text()
    assert EMULATION in md.splitlines()
    assert "| goodput | 0.625 (62.5%) |" in md
    assert "| tokens salvaged from dead islands (salvages; progress keepers replaced) | 8,192 (1; 2) |" in md
    island_rows = [line for line in md.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert island_rows == ["| 0 | fast | 2 | 1 | 1 | 40 | 81,920 |", "| 1 | slow | 1 | 0 | 0 | 25 | 51,200 |"]
    assert "- 9.5 s: kill_island on island 0 (incarnation 1): fired" in md
    assert "![held-out loss](loss.png)" in md and "![island timeline](timeline.png)" in md


def test_report_md_of_a_run_without_failures_blames_no_older_run():
    """A new run with nothing to detect has no n/a field, so no note about older runs; the faults row says how
    many of the tape's faults fired."""
    quiet = {**summary(), "failures": 0, "restarts": 0, "mean_time_to_detect_s": None, "mean_time_to_rejoin_s": None,
             "faults_planned": 0, "faults_injected": 0}
    md = render_markdown(Path("runs/quiet"), quiet, quiet["islands"], [], {}, {"loss": "-", "timeline": "-"})
    assert "| mean time to detect / to rejoin (s) | none (no failures) |" in md
    assert "n/a" not in md and "older run" not in md and "faults fired" not in md
    md = render_markdown(Path("runs/chaos"), summary(), summary()["islands"], [], {}, {"loss": "-", "timeline": "-"})
    assert "| faults fired | 1 of 2 planned (the token budget ran out first) |" in md
    assert "starting 4.5, training 32.0" in md, "the by-state row lists a first start as starting"


def test_only_a_summary_that_lacks_fields_is_called_an_older_run():
    old = {k: v for k, v in summary().items() if k not in ("goodput", "uptime")}
    md = render_markdown(Path("runs/old"), old, old["islands"], [], {}, {"loss": "-", "timeline": "-"})
    assert "| goodput | n/a |" in md
    assert "Fields shown as n/a are absent from this run's summary.json (an older run: no goodput, uptime)." in md
    unmeasured = {**summary(), "mean_time_to_rejoin_s": None}  # present, None: nothing to measure
    md = render_markdown(Path("runs/new"), unmeasured, [], [], {}, {"loss": "-", "timeline": "-"})
    assert "older run" not in md and "Fields shown as n/a had nothing to measure in this run." in md


def test_a_resumed_runs_first_start_is_no_rejoin():
    """Incarnation 3 of a resumed run's new session starts ("starting"): no rejoin; incarnation 4 after its
    failure rejoins. Every timeline state has a colour in the Gantt chart."""
    rows = [{"at": T0 + t, "island": 0, "incarnation": inc, "state": st} for t, inc, st in
            [(0.0, 3, "starting"), (2.0, 3, "training"), (5.0, 3, "dead"), (6.0, 4, "restarting"),
             (7.0, 4, "reintegrating"), (8.0, 4, "training"), (9.0, 4, "stopped")]]
    fails, rejoins = _marks(timeline_intervals(rows)[0])
    assert [iv.incarnation for iv in fails] == [3] and [(iv.incarnation, iv.start) for iv in rejoins] == [(4, 8.0)]
    assert tuple(STATE_COLORS) == TIMELINE_STATES and "starting" in STATE_COLORS


def test_timeline_intervals_mark_failure_and_rejoin():
    rows = [{"at": T0 + t, "island": i, "incarnation": inc, "state": st} for t, i, inc, st in TIMELINE]
    intervals, t0 = timeline_intervals(rows)
    assert t0 == T0
    island0 = [(iv.incarnation, iv.state, iv.start, iv.end) for iv in intervals if iv.island == 0]
    assert island0 == [(1, "starting", 0.0, 2.0), (1, "training", 2.0, 8.0), (1, "dead", 8.0, 9.0),
                       (2, "restarting", 9.0, 11.0), (2, "reintegrating", 11.0, 12.0), (2, "training", 12.0, 20.0)]
    assert all(iv.state != "stopped" for iv in intervals)


def test_missing_summary_is_a_one_line_error(tmp_path, capsys):
    run = make_run(tmp_path, with_summary=False)
    with pytest.raises(ReportError, match=r"has no summary\.json; is it a finished run directory\?") as err:
        write_report(run)
    assert str(run) in str(err.value) and "\n" not in str(err.value)
    assert main(["report", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().count("\n") == 0 and "has no summary.json" in captured.err


def test_run_without_timeline_still_reports(tmp_path):
    run = make_run(tmp_path, timeline=False)
    for kind in ("timeline", "faults"):  # an older run: these event kinds did not exist yet
        shutil.rmtree(run / "events" / kind)
    paths = write_report(run, tmp_path / "out")
    assert set(paths) == {"loss", "report"}
    assert_png(paths["loss"])
    md = paths["report"].read_text()
    assert "timeline is missing" in md and "![island timeline]" not in md
    assert "n/a: this run directory has no `faults` events" in md


def test_cli_passes_out_dir_and_prints_written_paths(tmp_path, capsys, monkeypatch):
    import orchestrator.run.report

    calls = []

    def fake(run_dir, out_dir, baseline=None):
        calls.append((run_dir, out_dir, baseline))
        return {"loss": Path(out_dir) / "loss.png", "report": Path(out_dir) / "report.md"}

    monkeypatch.setattr(orchestrator.run.report, "write_report", fake)
    assert main(["report", "runs/x", "--out", str(tmp_path)]) == 0
    assert calls == [("runs/x", str(tmp_path), None)]
    assert capsys.readouterr().out.split() == [str(tmp_path / "loss.png"), str(tmp_path / "report.md")]


def test_without_matplotlib_report_md_is_written_and_says_how_to_get_plots(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    paths = write_report(run)
    assert set(paths) == {"report"}
    assert sorted(p.name for p in (run / "report").iterdir()) == ["report.md"]
    md = paths["report"].read_text()
    assert "| goodput | 0.625 (62.5%) |" in md
    assert 'No loss.png: matplotlib is not installed; pip install -e ".[plots]"' in md
    assert "![held-out loss]" not in md


# The basic install has no matplotlib: a fresh interpreter with its import blocked runs `diloco report`.
NO_MPL = "import sys; sys.modules['matplotlib'] = None; from orchestrator.cli.main import main; sys.exit(main())"


@pytest.mark.parametrize("blocked", [True, False], ids=["basic-install", "plots-extra"])
def test_cli_report_with_and_without_matplotlib(tmp_path, blocked):
    run = make_run(tmp_path)
    root = Path(__file__).resolve().parents[2]
    code = NO_MPL if blocked else NO_MPL.replace("sys.modules['matplotlib'] = None; ", "")
    got = subprocess.run([sys.executable, "-c", code, "report", str(run)], cwd=root, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    written = sorted(p.name for p in (run / "report").iterdir())
    assert got.stdout.split() == [str(run / "report" / n) for n in (["report.md"] if blocked else
                                                                  ["loss.png", "timeline.png", "report.md"])]
    if blocked:
        assert written == ["report.md"]
        assert got.stderr == 'diloco report: no plots: matplotlib is not installed; pip install -e ".[plots]" ' \
                             "for loss.png and timeline.png\n"
    else:
        assert written == ["loss.png", "report.md", "timeline.png"] and "no plots" not in got.stderr
        assert_png(run / "report" / "loss.png")


def test_report_module_imports_neither_ray_nor_matplotlib():
    code = "import sys, orchestrator.run.report; sys.exit(bool({'ray', 'matplotlib'} & set(sys.modules)))"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


def test_report_md_timeline_and_loss_share_the_runs_clock(tmp_path, monkeypatch):
    """A fault shows at one time everywhere: report.md's run_s, the timeline's failure and its dotted mark.

    The run started 1.5 s after the first timeline event (islands start before the run's clock does): the
    timeline used to count from that first event, putting the failure 1.5 s before report.md's fault."""
    import orchestrator.run.report as report

    run = make_run(tmp_path)
    s = json.loads((run / "summary.json").read_text())
    s["run_start"] = T0 + 1.5
    (run / "summary.json").write_text(json.dumps(s))
    shutil.rmtree(run / "events" / "faults")
    log = EventLog(run)  # the fault as the injector records it on that clock: killed at T0 + 8.0, 6.5 s into the run
    log.add("faults", [{"island": 0, "incarnation": 1, "kind": "kill_island", "outcome": "fired", "at": T0 + 8.0, "run_s": 6.5}])
    log.flush()
    seen = {}
    monkeypatch.setattr(report, "plot_timeline", lambda intervals, labels, summary, path, title, fault_s=None, **kw:
                        seen.update(intervals=intervals, fault_s=fault_s, **kw))
    monkeypatch.setattr(report, "plot_loss", lambda evals, summary, fault_s, path, title: seen.update(loss_faults=fault_s))
    monkeypatch.setattr(report, "have_matplotlib", lambda: True)
    md = report.write_report(run)["report"].read_text()
    assert "- 6.5 s: kill_island on island 0 (incarnation 1): fired" in md
    dead = next(iv for iv in seen["intervals"] if iv.state == "dead")
    assert dead.start == pytest.approx(6.5) and seen["fault_s"] == [6.5] == seen["loss_faults"]
    assert seen["run_clock"] is True
    assert min(iv.start for iv in seen["intervals"]) == pytest.approx(-1.5)  # start-up, before the run's clock
    # Without run_start (an older summary.json), a fault's `at` minus its `run_s` gives the same clock.
    del s["run_start"]
    (run / "summary.json").write_text(json.dumps(s))
    report.write_report(run)
    assert next(iv for iv in seen["intervals"] if iv.state == "dead").start == pytest.approx(6.5)
