"""orchestrator.run.trained: a run's model from its run directory, `diloco sample` and `diloco export` (no Ray).

The run directories here are written as the driver and `diloco baseline-dp` write them (config.yaml and
checkpoints in orchestrator.core.checkpoint's format); tests/integration loads real runs' models.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml

from islands.model import build_model, model_config
from islands.sampling import generate
from orchestrator.cli.main import main as diloco
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.run.trained import EXPORT_FORMAT, TrainedModelError, evaluate_trained, export_model, load_exported, load_trained


def trained_params(seed: int) -> dict[str, torch.Tensor]:
    """Parameters unlike any build_model init: a nano model's, shifted."""
    model = build_model(model_config("nano"), seed=seed)
    return {n: p.detach() + 0.01 * (i + 1) for i, (n, p) in enumerate(model.named_parameters())}


def write_run(run_dir, *, mode: str = "decoupled", steps=(0, 4), preset: str = "nano", dp: bool = False,
              average: bool = False):
    """A run directory as `diloco train` (or, with dp, `diloco baseline-dp`) leaves it; returns each step's params.

    With `average`, each checkpoint also holds a served moving average (run.average_window): the params shifted by 0.5."""
    run_dir.mkdir(parents=True)
    cfg = build_config({"model": {"preset": preset}, "run": {"seed": 2}, "data": {"max_bytes": 1_000_000},
                        "eval": {"batches": 4, "batch_size": 8}})
    data = cfg.model_dump(mode="json")
    data["mode"] = "data-parallel" if dp else mode
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    store = CheckpointStore(run_checkpoint_uri(None, run_dir))
    saved = {}
    for step in steps:
        params = trained_params(seed=step)
        meta = ({"mode": "data-parallel", "steps": 9, "tokens_processed": 1234} if dp else
                {"outer": {"versions": [step, step + 1]}, "epoch": 0, "extra": {"tokens_processed": 1000 * step}})
        tensors = {f"param/{n}": t for n, t in params.items()}
        if not dp:
            tensors.update({f"momentum/{n}": torch.ones_like(t) for n, t in params.items()})
        if average:
            tensors.update({f"average/{n}": t + 0.5 for n, t in params.items()})
        store.save(step, tensors, meta)
        saved[step] = params
    return saved


def test_the_newest_checkpoint_loads_into_the_run_model(tmp_path):
    saved = write_run(tmp_path / "run")
    t = load_trained(tmp_path / "run")
    assert t.step == 4 and t.mode == "decoupled" and t.versions == [4, 5] and t.tokens_processed == 4000
    assert t.run_config.model.preset == "nano" and not t.model.training
    got = dict(t.model.named_parameters())
    assert set(got) == set(saved[4])
    for name, p in saved[4].items():
        assert torch.equal(got[name], p), name

    older = load_trained(tmp_path / "run", step=0)
    assert older.step == 0 and torch.equal(dict(older.model.named_parameters())["lm_head.weight"],
                                           saved[0]["lm_head.weight"])
    with pytest.raises(TrainedModelError, match=r"no checkpoint 3 under .*; it holds 0, 4 \(older ones are pruned"):
        load_trained(tmp_path / "run", step=3)


def test_a_data_parallel_run_loads_the_same_way(tmp_path):
    saved = write_run(tmp_path / "dp", steps=(9,), dp=True)
    t = load_trained(tmp_path / "dp")
    assert t.mode == "data-parallel" and t.step == 9 and t.versions is None and t.tokens_processed == 1234
    assert torch.equal(dict(t.model.named_parameters())["blocks.0.mlp.fc.weight"], saved[9]["blocks.0.mlp.fc.weight"])


@pytest.mark.parametrize("dp", [False, True])
def test_a_run_that_kept_a_moving_average_serves_it_and_raw_loads_the_global_model(tmp_path, capsys, dp):
    saved = write_run(tmp_path / "run", average=True, dp=dp, steps=(4,))
    served, raw = load_trained(tmp_path / "run"), load_trained(tmp_path / "run", raw=True)
    assert served.averaged and not raw.averaged
    for name, p in saved[4].items():
        assert torch.equal(dict(served.model.named_parameters())[name], p + 0.5), name
        assert torch.equal(dict(raw.model.named_parameters())[name], p), name
    assert evaluate_trained(served)["eval_loss"] != pytest.approx(evaluate_trained(raw)["eval_loss"], rel=1e-3)

    run = str(tmp_path / "run")
    assert diloco(["evaluate", run, "--set", "eval.batches=1"]) == 0
    averaged_out = capsys.readouterr().out
    assert diloco(["evaluate", run, "--set", "eval.batches=1", "--raw"]) == 0
    raw_out = capsys.readouterr().out
    assert ", moving average)" in averaged_out and "moving average" not in raw_out
    assert averaged_out.splitlines()[1] != raw_out.splitlines()[1], "two models, two losses"
    assert diloco(["export", run, "--out", str(tmp_path / "raw.pt"), "--raw"]) == 0
    exported = torch.load(tmp_path / "raw.pt", weights_only=True)["state_dict"]
    assert torch.equal(exported["lm_head.weight"], saved[4]["lm_head.weight"])


def test_what_cannot_be_loaded_is_refused_in_one_line(tmp_path):
    cases = []

    def refused(path, match, **kw):
        with pytest.raises(TrainedModelError, match=match) as err:
            load_trained(path, **kw)
        assert "\n" not in str(err.value)
        cases.append(match)

    refused(tmp_path / "nowhere", "is not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "has no config.yaml")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.yaml").write_text("outer:\n  min_quorm: 2\n")
    refused(tmp_path / "bad", r"is not a valid run config \(unknown config field 'outer.min_quorm'")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text("model:\n  preset: nano\n")
    refused(tmp_path / "fresh", "has no checkpoints at .*: the run failed before its first one")
    assert not (tmp_path / "fresh" / "checkpoints").exists(), "a failed load creates nothing"
    (tmp_path / "fresh" / "checkpoints" / "step-000000000001").mkdir(parents=True)  # interrupted save: no manifest
    refused(tmp_path / "fresh", "no complete checkpoint under")

    # A config that no longer matches the checkpoint's model.
    write_run(tmp_path / "edited", steps=(1,))
    cfg = yaml.safe_load((tmp_path / "edited" / "config.yaml").read_text())
    cfg["model"]["d_model"] = 64
    (tmp_path / "edited" / "config.yaml").write_text(yaml.safe_dump(cfg))
    refused(tmp_path / "edited", r"tok_emb.weight has shape \(256, 32\) but the model of its config.yaml wants "
                                 r"\(256, 64\); was config.yaml changed")
    cfg["model"].update(d_model=None, n_layers=2)
    (tmp_path / "edited" / "config.yaml").write_text(yaml.safe_dump(cfg))
    refused(tmp_path / "edited", "does not fit the model of its config.yaml .*: the model has 'blocks.1.")

    # A payload damaged after it was written fails its checksum.
    write_run(tmp_path / "damaged", steps=(1,))
    payload = next((tmp_path / "damaged" / "checkpoints").glob("step-*/tensors.bin"))
    raw = bytearray(payload.read_bytes())
    raw[100] ^= 0xFF
    payload.write_bytes(bytes(raw))
    refused(tmp_path / "damaged", "sha256")
    assert len(cases) == 8


def test_export_writes_a_plain_pytorch_file_that_rebuilds_the_model(tmp_path):
    write_run(tmp_path / "run")
    t = load_trained(tmp_path / "run")
    out = export_model(t, tmp_path / "model.pt")
    payload = torch.load(out, weights_only=True)  # plain tensors and values: the safe loader reads it
    assert payload["format"] == EXPORT_FORMAT and payload["step"] == 4 and payload["mode"] == "decoupled"
    assert payload["model_config"]["d_model"] == 32 and payload["tokens_processed"] == 4000
    model = load_exported(out)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x), t.model(x))
    assert {p.name for p in tmp_path.iterdir()} == {"run", "model.pt"}, "no temporary file is left"

    # An existing file is kept unless asked; a missing folder is named.
    before = out.read_bytes()
    with pytest.raises(TrainedModelError, match="already exists; pass another path, or overwrite it"):
        export_model(load_trained(tmp_path / "run", step=0), out)
    assert out.read_bytes() == before
    export_model(load_trained(tmp_path / "run", step=0), out, overwrite=True)
    assert torch.load(out, weights_only=True)["step"] == 0
    with pytest.raises(TrainedModelError, match="is not a directory; create it"):
        export_model(t, tmp_path / "no" / "model.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(TrainedModelError, match="is not a readable PyTorch file"):
        load_exported(tmp_path / "junk.pt")
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(TrainedModelError, match="is not a `diloco export` file"):
        load_exported(tmp_path / "other.pt")


def test_diloco_sample_and_export_on_the_command_line(tmp_path, capsys):
    write_run(tmp_path / "run")
    run = str(tmp_path / "run")
    assert diloco(["sample", run, "--prompt", "def ", "--bytes", "12", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    want = generate(load_trained(run).model, list(b"def "), max_new_tokens=12, temperature=0)
    assert out == (b"def " + bytes(want)).decode("utf-8", errors="replace") + "\n"
    assert "checkpoint 4 (decoupled, versions [4, 5], 0.00M tokens processed)" in err

    assert diloco(["sample", run, "--prompt", ""]) == 2
    assert capsys.readouterr().err == "diloco sample: --prompt is empty; give some text to continue, e.g. --prompt 'def '\n"
    assert diloco(["sample", run, "--top-k", "0"]) == 2
    assert capsys.readouterr().err.startswith("diloco sample: top_k=0 must be")
    assert diloco(["sample", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err

    assert diloco(["export", run, "--out", str(tmp_path / "m.pt"), "--step", "0"]) == 0
    assert "parameters from" in capsys.readouterr().out
    assert torch.load(tmp_path / "m.pt", weights_only=True)["step"] == 0
    assert diloco(["export", run, "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err
    assert diloco(["export", run, "--out", str(tmp_path / "m.pt"), "--force"]) == 0
    assert torch.load(tmp_path / "m.pt", weights_only=True)["step"] == 4


def test_evaluate_scores_the_run_held_out_windows_or_another_corpus(tmp_path, capsys):
    from islands.data import heldout_batches
    from orchestrator.run.streams import corpus_stream

    write_run(tmp_path / "run")
    t = load_trained(tmp_path / "run")
    got = evaluate_trained(t)
    # By hand: mean cross-entropy of the model over the run's 4 held-out windows of 8 x 32 bytes.
    heldout = corpus_stream(t.run_config).heldout
    batches = heldout_batches(heldout, seq_len=32, batch_size=8, num_batches=4)
    with torch.no_grad():
        want = sum(float(F.cross_entropy(t.model(x).reshape(-1, 256), y.reshape(-1))) for x, y in batches) / 4
    assert got["eval_loss"] == pytest.approx(want, rel=1e-6) and got["tokens"] == 4 * 8 * 32
    assert got["eval_bits_per_token"] == pytest.approx(want / 0.6931471805599453, rel=1e-6)
    assert got["source"].startswith("Python") and got["unigram_bits_per_token"] > 3

    # Another corpus: a Parquet file of the user's, and more windows.
    rows = [f"row {i}: " + "the quick brown fox jumps over the lazy dog. " * 4 for i in range(400)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "mine.parquet")
    other = evaluate_trained(t, ["data.source=parquet", f"data.path={tmp_path / 'mine.parquet'}",
                                 "data.text_column=text", "data.heldout_fraction=0.4", "eval.batches=6"])
    assert other["tokens"] == 6 * 8 * 32 and "mine.parquet" in other["source"]
    assert other["eval_loss"] != pytest.approx(got["eval_loss"], rel=1e-3)
    assert other["unigram_bits_per_token"] < got["unigram_bits_per_token"], "a repetitive text has fewer bits per byte"

    # Only data and eval may change, and bad data is named in one line.
    with pytest.raises(TrainedModelError, match="evaluation takes data.\\* and eval.\\* fields only"):
        evaluate_trained(t, ["model.d_model=64"])
    with pytest.raises(TrainedModelError, match="nowhere.parquet") as err:
        evaluate_trained(t, ["data.source=parquet", f"data.path={tmp_path / 'nowhere.parquet'}", "data.text_column=text"])
    assert "\n" not in str(err.value)

    assert diloco(["evaluate", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    # A byte-level model's tokens are bytes: the CLI says "per byte", as the README and `diloco train` do.
    assert got["unit"] == other["unit"] == "byte"
    assert f"held-out loss {got['eval_loss']:.4f} nats/byte, {got['eval_bits_per_token']:.3f} bits/byte" in out
    assert "over 1,024 bytes of Python" in out and "bits/token" not in out
    # A corpus of token ids is scored per token.
    pq.write_table(pa.table({"ids": [[(7 * i + j) % 200 for j in range(300)] for i in range(100)]}), tmp_path / "ids.parquet")
    assert evaluate_trained(t, ["data.source=parquet", f"data.path={tmp_path / 'ids.parquet'}",
                                "data.token_column=ids", "data.heldout_fraction=0.4"])["unit"] == "token"
    assert f"unigram model of the same data: {got['unigram_bits_per_token']:.3f} bits/byte" in out
    assert diloco(["evaluate", str(tmp_path / "run"), "--set", "run.seed=3"]) == 2
    assert capsys.readouterr().err.startswith("diloco evaluate: --set 'run.seed=3': evaluation takes")


def test_a_run_directory_loads_though_its_config_holds_a_setting_without_effect(tmp_path):
    """config.yaml records what a run resolved, or what an older version of the engine accepted: the rules that
    refuse a setting with no effect (config.INERT_RULES) are for what a user types, not for a run to read back."""
    saved = write_run(tmp_path / "run")
    path = tmp_path / "run" / "config.yaml"
    data = yaml.safe_load(path.read_text())
    data["network"]["local_step_s"] = 0.5  # no effect under network scenario none: refused as input
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(Exception, match="has no effect"):
        build_config({k: v for k, v in data.items() if k != "mode"})
    trained = load_trained(tmp_path / "run")
    got = dict(trained.model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in saved[4].items())
