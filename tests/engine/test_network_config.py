"""The network section of the config, the driver's network construction and the final table's label (no Ray)."""

from __future__ import annotations

import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.run.driver import build_run_network
from orchestrator.run.summary import format_summary

POOLS = "pools=[{name: a, islands: 2, region: us-east}, {name: b, islands: 1, region: eu-west}]"


def test_islands_take_their_pools_regions_and_the_step_is_measured_only_when_needed():
    calls = []

    def step_s() -> float:
        calls.append(1)
        return 0.1

    cfg = load_config(None, ["network.scenario=wan-8-regions", POOLS])
    net, regions = build_run_network(cfg, 4 * 30_000, step_s)
    assert regions == {0: "us-east", 1: "us-east", 2: "eu-west"}
    assert net.emulated and net.hub == "us-central" and calls == [1]
    assert net.describe().startswith("EMULATED network wan-8-regions (hub us-central: eu-west 2 Gbps/50 ms, us-east")
    # A configured step time is used as is; scenario none never measures.
    cfg = load_config(None, ["network.scenario=wan-8-regions", "network.local_step_s=0.5", POOLS])
    assert build_run_network(cfg, 4 * 30_000, step_s)[0].scale == pytest.approx(0.5 / 1.6062745)
    none, _ = build_run_network(load_config(None, [POOLS]), 4 * 30_000, step_s)
    assert not none.emulated and none.transfer_s(10**9, "eu-west") == 0.0 and calls == [1]


def test_bad_network_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"network.scenario': unknown network scenario 'wan'; use one of none, lan"):
        load_config(None, ["network.scenario=wan"])
    with pytest.raises(ConfigError, match=r"network.local_step_s"):
        load_config(None, ["network.local_step_s=0"])
    cfg = load_config(None, ["network.scenario=wan-4-regions"])  # default pools are in region 'local'
    with pytest.raises(ConfigError, match=r"^network: region 'local' is not in network scenario 'wan-4-regions'; "
                                          r"set the pool's region .* us-central, us-east, us-south, us-west$"):
        build_run_network(cfg, 4 * 30_000, lambda: 0.1)


# The fields format_summary reads, for a run with no islands and no emulation.
SUMMARY = {"mode": "decoupled", "eval_loss": 2.0, "eval_bits_per_byte": 2.9, "unigram_bits_per_byte": 4.8,
           "tokens_processed": 1000, "tokens_merged": 900, "tokens_refused": 0, "tokens_in_flight": 100,
           "rounds": 3, "refusals": 0, "bytes_sent": 2e6, "wall_s": 10.0, "islands": [], "emulation": None}


def test_final_table_labels_an_emulated_network():
    line = "EMULATED network wan-4-regions (hub us-central: us-west 2 Gbps/20 ms), scaled ..."
    assert line in format_summary({**SUMMARY, "network": line, "network_emulated": True}).splitlines()
    assert "EMULATED" not in format_summary({**SUMMARY, "network": "network none", "network_emulated": False})


def test_the_summary_names_the_moving_average_and_the_raw_models_loss_when_it_served_one():
    def loss(s: dict) -> str:
        return next(ln for ln in format_summary({**s, "network_emulated": False}).splitlines() if ln.startswith("held-out loss"))

    assert loss(SUMMARY).split() == ["held-out", "loss", "(nats/byte)", "2.0000"]
    assert loss({**SUMMARY, "eval_loss_raw": 2.03125}).endswith("2.0000 (moving average; raw global model 2.0312)")
    assert loss({**SUMMARY, "eval_loss_raw": None}).endswith("2.0000"), "a run without averaging"


def test_the_summary_names_an_islands_device_and_precision_only_when_not_cpu_fp32():
    isl = {"pool": "p", "steps": 5, "tokens": 640, "state": "stopped"}
    islands = [{**isl, "island": 0, "device": "cpu", "precision": "fp32"},
               {**isl, "island": 1, "device": "cuda:0 (NVIDIA H200)", "precision": "bf16"},
               {**isl, "island": 2, "device": "cpu", "precision": "bf16"},
               {**isl, "island": 3}]  # a summary from before islands named them
    lines = [ln.strip() for ln in format_summary({**SUMMARY, "islands": islands, "network_emulated": False}).splitlines() if "island " in ln]
    assert [ln.split("  ")[-1].strip() for ln in lines] == [
        "5 steps, 640 tokens, stopped", "5 steps, 640 tokens, stopped, cuda:0 (NVIDIA H200) bf16",
        "5 steps, 640 tokens, stopped, cpu bf16", "5 steps, 640 tokens, stopped"]


def test_the_scaling_step_is_timed_with_every_island_stepping(monkeypatch, caplog):
    from islands.data import load_stdlib_corpus
    from islands.model import model_config
    from orchestrator.run import driver

    # Islands on one machine share its cores: by default every island worker steps at once.
    cfg = load_config(None, ["pools=[{name: a, islands: 2, workers_per_island: 2}, {name: b, islands: 1}]"])
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    assert driver.step_concurrency(cfg) == 5
    assert driver.step_concurrency(load_config(None, ["network.scenario=wan-8-regions", POOLS, "network.step_concurrency=1"])) == 1
    # On a multi-node cluster the islands have their own machines (stand-in for ray.nodes(): one dead node).
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(driver.ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}, {"Alive": False}])
    assert driver.step_concurrency(cfg) == 1
    monkeypatch.setattr(driver.ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert driver.step_concurrency(cfg) == 5

    corpus = load_stdlib_corpus(max_bytes=200_000, heldout_fraction=0.1)
    with caplog.at_level("INFO", logger="orchestrator.run.driver"):
        step_s = driver.measure_step_s(cfg, model_config("nano"), corpus.train, steps=2, concurrency=3)
    assert step_s > 0
    assert "median of 6 steps, 3 stepping side by side" in caplog.text


def test_the_driver_measures_the_step_once_and_keeps_it_in_the_config(monkeypatch):
    from orchestrator.run import driver
    from orchestrator.run.driver import with_measured_step

    # A driver about to start its own Ray (this test process may have joined the suite's cluster).
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)

    none = load_config(None, [POOLS])
    assert with_measured_step(none, None) is none  # no emulated network: nothing to measure
    fixed = load_config(None, ["network.scenario=wan-8-regions", "network.local_step_s=0.5", POOLS])
    assert with_measured_step(fixed, None) is fixed
    cfg = load_config(None, ["network.scenario=wan-8-regions", "network.step_concurrency=2", "model.preset=nano",
                             "data.max_bytes=200000", POOLS])
    assert with_measured_step(cfg, "127.0.0.1:6379") is cfg  # joining a cluster: measured at setup
    with monkeypatch.context() as m:
        m.setattr(driver.ray, "is_initialized", lambda: True)
        assert with_measured_step(cfg, None) is cfg  # Ray already up in this process: measured at setup
    got = with_measured_step(cfg, None)
    assert got.network.local_step_s > 0 and cfg.network.local_step_s is None
    # Only that field changed: the run directory's config.yaml records the links a resume will reuse.
    assert got.model_copy(update={"network": cfg.network}) == cfg


def test_gpu_pools_scale_the_links_to_a_gpu_step_or_ask_for_it(monkeypatch):
    """A CPU step of the model can be 50x a GPU step (benchmarks/gpu_check.py on an H200): links scaled to it
    would be far too fast for GPU islands, so the step is timed on a GPU, or the config must give it."""
    import torch

    from orchestrator.run import driver
    from orchestrator.run.driver import step_concurrency, step_device, with_measured_step

    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    gpu = "pools=[{name: g, islands: 3, accelerator: H100, gpus_per_worker: 0.25}, {name: c, islands: 2}]"
    cfg = load_config(None, ["network.scenario=wan-4-regions", "model.preset=nano", gpu])
    assert step_device(load_config(None, [POOLS])) == "cpu"
    if not torch.cuda.is_available():  # this project's machines: refused before anything starts, fix named
        with pytest.raises(ConfigError, match=r"pools g train on GPUs and this driver has no CUDA to time their "
                                              r"step; set network.local_step_s"):
            with_measured_step(cfg, None)
    given = load_config(None, ["network.scenario=wan-4-regions", "network.local_step_s=0.02", gpu])
    assert with_measured_step(given, None) is given  # the step is given: nothing to time
    # Timed on GPUs, only the GPU islands step side by side, spread over the cards.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert step_device(cfg) == "cuda"
    assert step_concurrency(cfg, gpu=True) == 2 and step_concurrency(cfg) == 5


def test_a_pool_precision_overrides_inner_precision_for_its_islands_and_the_timed_step(monkeypatch):
    # Mixed generations in one run: bf16 on the new pool, the run's fp32 on the old one.
    from islands.data import load_stdlib_corpus
    from islands.model import model_config
    from orchestrator.run import driver
    from orchestrator.settings import inner_settings

    cfg = load_config(None, ["inner.precision=fp32", "pools=[{name: new, precision: bf16}, {name: old}]"])
    new, old = cfg.pools
    assert inner_settings(cfg, new).precision == "bf16"
    assert inner_settings(cfg, old).precision == "fp32"
    assert inner_settings(cfg).precision == "fp32"  # no pool: the run's (data parallel's) arithmetic

    # The links are scaled to a step in the timed pool's arithmetic, not the run's default.
    seen = []

    class Recording(driver.InnerTrainer):
        def __init__(self, *args, settings, **kwargs):
            seen.append(settings.precision)
            super().__init__(*args, settings=settings, **kwargs)

    monkeypatch.setattr(driver, "InnerTrainer", Recording)
    corpus = load_stdlib_corpus(max_bytes=200_000, heldout_fraction=0.1)
    driver.measure_step_s(cfg, model_config("nano"), corpus.train, steps=1, concurrency=2)
    assert seen == ["bf16", "bf16"]
