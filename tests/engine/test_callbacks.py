"""Run callbacks without Ray (orchestrator/run/callbacks.py): the dispatch, a failing hook never stopping the run,
the metrics handed to the hooks, island events from the monitor's timeline, run.trackers in the config, and
`diloco train --tracker`. The trackers themselves log a real run in tests/integration/test_trackers.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from islands.spec import DataCursor, IslandStatus
from orchestrator.cli.main import build_parser
from orchestrator.cli.train import with_tracker_flags
from orchestrator.config import ConfigError, RunConfig, build_config, load_config, tracker_spec
from orchestrator.run import trackers
from orchestrator.run.callbacks import Callback, Callbacks, RunInfo, check_callbacks, eval_metrics, round_metrics
from orchestrator.run.preflight import preflight
from orchestrator.run.stopping import StopRequest


class Recorder(Callback):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_start(self, run):
        self.calls.append((self.name, "start", run.run_id))

    def on_eval(self, run, metrics):
        self.calls.append((self.name, "eval", metrics["tokens"]))

    def on_round(self, run, metrics):
        self.calls.append((self.name, "round", metrics["tokens"]))

    def on_island_event(self, run, event):
        self.calls.append((self.name, "island", event["kind"]))

    def on_end(self, run, summary):
        self.calls.append((self.name, "end", summary["stopped_by"]))


class Broken(Callback):
    def on_eval(self, run, metrics):
        raise RuntimeError("tracker down")


class Exits(Callback):
    def on_eval(self, run, metrics):
        raise SystemExit(3)


def info(stop: StopRequest | None = None) -> RunInfo:
    stop = stop or StopRequest()
    return RunInfo(run_dir=Path("/tmp/run").resolve(), run_id="run-abc123", config=RunConfig(), resumed=False,
                   request_stop=lambda reason: stop.ask(reason) and None)


POINT = {"wall_s": 1.5, "at": 0.0, "tokens_processed": 4096, "tokens_merged": 2048.0, "versions": [2, 3],
         "eval_loss": 3.1, "eval_bits_per_byte": 4.47}
LEDGER = {"processed": [1000, 1000], "merged": [600, 601], "refused": [100, 100], "in_flight": [250, 249],
          "lost": [50, 50], "overwritten": [0, 0]}
STATUS = {"versions": [4, 5], "rounds": 9, "refusals": 2, "bytes_up": 300, "bytes_down": 700}


def status(island: int, loss: float | None) -> IslandStatus:
    return IslandStatus(island=island, incarnation=1, pool="fast", state="training", steps=3, tokens=10, train_loss=loss,
                        step_time_s=0.1, versions=[0, 0], unsubmitted_tokens=[0, 0], outbox_tokens=[0, 0], inflight=0,
                        cursor=DataCursor())


def test_every_hook_reaches_every_callback_in_order_and_end_once():
    calls: list = []
    cbs = Callbacks([Recorder("a", calls), Recorder("b", calls)], info())
    cbs.start()
    cbs.eval(POINT)
    cbs.round(ledger=LEDGER, status=STATUS, statuses=[], new_rounds=1, wall_s=5.0)
    cbs.end({"stopped_by": "token_budget"})
    cbs.end({"stopped_by": "token_budget"})
    cbs.fail(RuntimeError("after the end"))  # a no-op: the run ended already
    assert calls == [("a", "start", "run-abc123"), ("b", "start", "run-abc123"), ("a", "eval", 4096), ("b", "eval", 4096),
                     ("a", "round", 1000), ("b", "round", 1000), ("a", "end", "token_budget"), ("b", "end", "token_budget")]


def test_a_failing_hook_is_logged_once_and_the_others_still_run(caplog):
    calls: list = []
    cbs = Callbacks([Broken(), Recorder("ok", calls)], info())
    cbs.start()
    with caplog.at_level(logging.WARNING, logger="orchestrator.run.callbacks"):
        for _ in range(3):
            cbs.eval(POINT)
    assert [c[1] for c in calls] == ["start", "eval", "eval", "eval"]
    warned = [r for r in caplog.records if "Broken.on_eval failed" in r.getMessage()]
    assert len(warned) == 1 and "tracker down" in warned[0].getMessage()


def test_system_exit_and_keyboard_interrupt_in_a_hook_propagate():
    cbs = Callbacks([Exits()], info())
    with pytest.raises(SystemExit):
        cbs.eval(POINT)


def test_a_run_that_raised_ends_its_callbacks_as_failed_or_interrupted():
    calls: list = []
    cbs = Callbacks([Recorder("a", calls)], info())
    cbs.fail(RuntimeError("x"))  # never started: nothing to end
    assert calls == []
    cbs.start()
    cbs.fail(RuntimeError("outer optimizer lost\nmore"))
    assert calls[-1] == ("a", "end", "failed")
    seen: list = []

    class Summary(Callback):
        def on_end(self, run, summary):
            seen.append(summary)

    other = Callbacks([Summary()], info())
    other.start()
    other.fail(KeyboardInterrupt())
    assert seen == [{"stopped_by": "interrupted", "error": "KeyboardInterrupt: KeyboardInterrupt"}]


def test_no_callbacks_costs_nothing_and_needs_no_run_info():
    cbs = Callbacks(None, None)
    assert not cbs
    cbs.start()
    cbs.eval(POINT)
    cbs.round(ledger=None, status=None, statuses=None, new_rounds=0, wall_s=0)  # arguments never read
    cbs.island_events({"timeline": [(1.0, 0, 1, "dead")]}, 0)
    cbs.end({})
    cbs.fail(None)


def test_request_stop_asks_the_run_to_stop_with_the_reason():
    stop = StopRequest()
    stop.stoppable = True
    info(stop).request_stop("tune: trial pruned")
    assert stop.reason == "tune: trial pruned"


def test_the_metrics_are_the_ledger_and_status_as_shown_everywhere():
    assert eval_metrics(POINT) == {"tokens": 4096, "eval_loss": 3.1, "eval_bits_per_byte": 4.47, "versions": 5,
                                   "tokens_merged": 2048.0, "wall_s": 1.5}
    m = round_metrics(ledger=LEDGER, status=STATUS, statuses=[status(0, 2.0), status(1, 3.0), status(2, None)],
                      new_rounds=2, wall_s=12.0, goodput=0.8, uptime=None)
    # Whole tokens that add up to processed (shown_fates: the progress line's and the final table's rounding).
    fates = {k: m[f"tokens_{k}"] for k in ("merged", "refused", "in_flight", "lost", "overwritten")}
    assert m["tokens"] == 1000 and sum(fates.values()) == 1000 and fates["lost"] == 50
    assert (m["versions"], m["rounds"], m["new_rounds"], m["refusals"], m["bytes_sent"]) == (9, 9, 2, 2, 1000)
    assert m["train_loss"] == 2.5 and m["goodput"] == 0.8 and "uptime" not in m, "unknown values are left out"


def test_island_events_come_from_the_timeline_once_each_with_the_detection():
    calls: list = []
    events: list = []

    class Events(Callback):
        def on_island_event(self, run, event):
            events.append(event)

    cbs = Callbacks([Recorder("a", calls), Events()], info())
    snap = {"slots": {0: {"pool": "fast"}, 1: {"pool": "slow"}},
            "timeline": [(1.0, 0, 1, "starting"), (2.0, 0, 1, "training"), (3.0, 1, 1, "dead")],
            "detections": [{"island": 1, "incarnation": 1, "kind": "crash", "reason": "actor died"}]}
    cbs.island_events(snap, tokens=500)
    snap["timeline"] += [(4.0, 1, 2, "restarting"), (5.0, 1, 2, "reintegrating"), (6.0, 1, 2, "training")]
    cbs.island_events(snap, tokens=900)
    assert [c[2] for c in calls] == ["failure", "restart", "reintegration"]
    assert events[0] == {"kind": "failure", "island": 1, "pool": "slow", "incarnation": 1, "state": "dead", "at": 3.0,
                         "tokens": 500, "failure_kind": "crash", "reason": "actor died"}
    assert events[1]["tokens"] == 900 and events[1]["incarnation"] == 2


def test_callbacks_must_be_callback_instances():
    check_callbacks(None)
    check_callbacks([Recorder("a", [])])
    for bad in (Recorder("a", []), [Recorder], ["mlflow"], "mlflow"):
        with pytest.raises(ConfigError) as err:
            check_callbacks(bad)
        assert "\n" not in str(err.value) and "Callback" in str(err.value)


# ------------------------------------------------------------------ run.trackers and --tracker


@pytest.mark.parametrize("entry,spec", [("mlflow", ("mlflow", None)), ("mlflow:http://host:5000", ("mlflow", "http://host:5000")),
                                        ("tensorboard:/data/tb", ("tensorboard", "/data/tb")), ("wandb", ("wandb", None)),
                                        ("wandb:my-project", ("wandb", "my-project"))])
def test_tracker_entries_parse(entry, spec):
    assert tracker_spec(entry) == spec
    assert build_config({"run": {"trackers": [entry]}}).run.trackers == [entry]


@pytest.mark.parametrize("entry", ["comet", "mlflow:", "MLflow", "tensorboard: ", "", "wandb\n"])
def test_a_bad_tracker_entry_is_one_line_naming_it_and_the_forms(entry):
    with pytest.raises(ConfigError) as err:
        build_config({"run": {"trackers": ["tensorboard", entry]}})
    text = str(err.value)
    assert "\n" not in text and "run.trackers" in text and "mlflow:TRACKING_URI" in text and "tensorboard:DIR" in text


def test_trackers_default_to_none_and_one_name_is_a_list_of_one():
    assert RunConfig().run.trackers == []
    assert load_config(None, ["run.trackers=mlflow"]).run.trackers == ["mlflow"]


def test_the_tracker_flag_appends_to_run_trackers_once_each():
    parser = build_parser("train")
    args = parser.parse_args(["train", "--tracker", "mlflow:http://h:5000", "--tracker", "tensorboard", "--tracker", "wandb",
                              "--tracker", "wandb"])
    cfg = with_tracker_flags(load_config(None, ["run.trackers=[tensorboard]"]), args)
    assert cfg.run.trackers == ["tensorboard", "mlflow:http://h:5000", "wandb"]
    assert with_tracker_flags(RunConfig(), parser.parse_args(["train"])) == RunConfig()
    with pytest.raises(ConfigError, match=r"^--tracker: unknown tracker 'neptune'; use mlflow"):
        with_tracker_flags(RunConfig(), parser.parse_args(["train", "--tracker", "neptune"]))


def test_a_tracker_not_installed_fails_in_preflight_in_one_line(monkeypatch, tmp_path):
    # The package each tracker imports, pointed at a module that is not installed anywhere.
    monkeypatch.setitem(trackers._PACKAGES, "mlflow", "no_such_tracker_package")
    with pytest.raises(ConfigError) as err:
        preflight(build_config({"run": {"trackers": ["mlflow:http://h:5000"]}}), tmp_path / "run")
    assert str(err.value) == 'run.trackers: mlflow is not installed; pip install -c constraints-cpu.txt -e ".[trackers]"'
    assert not (tmp_path / "run").exists()
    with pytest.raises(ImportError, match="mlflow is not installed"):
        trackers.MLflowCallback()


def test_the_diloco_train_command_refuses_a_bad_tracker_before_ray(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", "--run-dir", str(tmp_path / "r"), "--tracker",
                          "mlflow:"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "diloco train: --tracker: unknown tracker 'mlflow:'; use mlflow, mlflow:TRACKING_URI, tensorboard, tensorboard:DIR, "
        "wandb or wandb:PROJECT"]


def test_flat_config_spells_keys_as_set_does_and_the_status_follows_the_stop():
    flat = trackers.flat_config(RunConfig())
    assert flat["outer.lr"] == str(RunConfig().outer.lr) and flat["pools.fast.islands"] == "2"
    assert flat["run.trackers"] == "[]" and flat["model.factory"] == "null" and flat["model.preset"] == "tiny"
    assert all(isinstance(v, str) for v in flat.values())
    assert [trackers.tracker_status({"stopped_by": s}) for s in
            ("token_budget", "stop_at_eval_loss", "max_wall_s", "interrupted", "stop request", "failed")] == [
        "FINISHED", "FINISHED", "FINISHED", "KILLED", "KILLED", "FAILED"]


def test_the_drivers_flush_hands_the_rounds_and_goodput_to_on_round():
    """Run._periodic at a flush (no Ray: a Run without its set-up, stand-ins for the actor calls): on_round gets
    the ledger, the tick's status, the rounds just drained and the goodput the metrics just recorded."""
    from orchestrator.run.driver import Run
    from orchestrator.run.ledger import SessionLedger

    class Events:
        def flush(self):
            pass

    class Metrics:
        def record_goodput_so_far(self, fetch, **_):
            return {"goodput": 0.75, "uptime": 0.5}

    got: list = []

    class Rounds(Callback):
        def on_round(self, run, metrics):
            got.append(metrics)

    run = Run.__new__(Run)
    run.cfg = build_config({"eval": {"interval_s": 10.0}})
    run.events, run.metrics, run.run_start = Events(), Metrics(), 0.0
    run.ledger = SessionLedger(fragments=2)
    run.ledger.current = LEDGER
    run.snapshot = {"slots": {0: {"status": status(0, 2.0), "finals": []}}}
    run.callbacks = Callbacks([Rounds()], info())
    run._drain_events = lambda: 3
    next_eval, next_flush, stop = run._periodic(0.0, 5.0, 100.0, 5.0, STATUS)
    assert next_flush == 10.0 and not stop
    (m,) = got
    assert (m["tokens"], m["new_rounds"], m["rounds"], m["goodput"], m["uptime"], m["train_loss"], m["wall_s"]) == (
        1000, 3, 9, 0.75, 0.5, 2.0, 5.0)
