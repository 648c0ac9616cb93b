"""`diloco export/sample/evaluate` for a user's model (orchestrator.run.trained): no Ray.

Each run directory is faked the way a real run leaves it: the model built by the run's recipe, trained a
few steps in this process (so its state differs from the factory's), config.yaml naming the factory by
import path, and one checkpoint written by the outer optimizer's state_dict into a CheckpointStore, as
orchestrator.run.setup.save_checkpoint_zero writes checkpoint 0.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from islands.model_api import default_loss, instantiate, resolve_callable, state_tensors
from islands.sampling import ByteText, generate, sample_text
from orchestrator.cli.main import main as diloco
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.run.trained import (
    MODULE_EXPORT_FORMAT,
    TrainedModelError,
    export_model,
    load_exported,
    load_trained,
    run_text_codec,
)
from orchestrator.settings import model_recipe, outer_settings
from policies.fragments import plan_fragments
from tests.api import zoo

GPT2, LLAMA, CNN = "tests.api.zoo:tiny_gpt2", "tests.api.zoo:tiny_llama", "tests.api.zoo:small_cnn"


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, zoo.VOCAB, (4, zoo.SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def cnn_batch(step: int) -> dict:
    data = zoo.Shapes(16, seed=step)
    return {k: torch.stack([data[i][k] for i in range(len(data))]) for k in ("image", "label")}


def fake_run(run_dir, factory: str, *, loss: str | None = None, steps: int = 3) -> None:
    """A run directory whose one checkpoint (number 7) holds `factory`'s model after `steps` AdamW steps."""
    run_dir.mkdir(parents=True)
    cfg = build_config({"model": {"preset": "nano", "factory": factory, "loss": loss}, "run": {"seed": 2},
                        "data": {"max_bytes": 200_000, "source": "python" if loss else "stdlib"},
                        "eval": {"batches": 1, "batch_size": 4}})
    recipe = model_recipe(cfg)
    model = instantiate(recipe.model, recipe.seed)
    loss_fn = resolve_callable(recipe.loss, "loss") or default_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):  # BatchNorm's running statistics move too (train mode)
        opt.zero_grad()
        loss_fn(model, cnn_batch(step) if loss else lm_batch(step)).backward()
        opt.step()
    state = {n: t.detach().clone() for n, t in state_tensors(model).items()}
    fresh = state_tensors(instantiate(recipe.model, recipe.seed))
    assert all(not torch.equal(state[n], fresh[n]) for n in state if n.endswith("weight")), "trained, not as built"

    data = cfg.model_dump(mode="json")
    data["mode"] = "decoupled"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in state.items()], cfg.outer.num_fragments)
    tensors, meta = OuterOptimizer(state, plan, settings=outer_settings(cfg)).state_dict()
    CheckpointStore(run_checkpoint_uri(None, run_dir)).save(7, tensors, {"outer": meta, "epoch": 0,
                                                                         "extra": {"tokens_processed": 1234}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One faked run per zoo model (built once: each costs a model build and a few training steps)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("runs")
    fake_run(root / "gpt2", GPT2)
    fake_run(root / "llama", LLAMA)
    fake_run(root / "cnn", CNN, loss="tests.api.zoo:cnn_loss")
    return root


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_hugging_face_model_exports_as_a_folder_that_from_pretrained_reloads_exactly(runs, tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM

    run = runs / name
    trained = load_trained(run)
    if name == "gpt2":  # the tokenizer hook: a run's Hugging Face tokenizer file goes into the folder
        (run / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    folder = tmp_path / "hf"
    assert diloco(["export", str(run), "--out", str(folder), "--format", "hf"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{folder}: ") and "parameters (Hugging Face folder) from" in out and "checkpoint 7 (decoupled" in out and not err
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file() == (name == "gpt2")
    assert {p.name for p in tmp_path.iterdir()} == {"hf"}, "no temporary folder is left"

    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(reloaded) is type(trained.model)
    x = torch.randint(0, zoo.VOCAB, (2, zoo.SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, trained.model(x).logits)
    if name == "gpt2":
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight, "the head stays tied"
        (run / "tokenizer.json").unlink()

    # --format torch of the same model: the whole state dict (a tied weight under both names), rebuilt strictly.
    assert diloco(["export", str(run), "--out", str(tmp_path / "m.pt")]) == 0
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    assert payload["format"] == MODULE_EXPORT_FORMAT and payload["factory"] == f"tests.api.zoo:tiny_{name}"
    assert set(payload["state_dict"]) == set(trained.model.state_dict())
    assert payload["step"] == 7 and payload["tokens_processed"] == 1234 and payload["mode"] == "decoupled"
    again = load_exported(tmp_path / "m.pt")
    with torch.no_grad():
        assert torch.equal(again(x).logits, trained.model(x).logits)
    if name == "gpt2":
        assert "lm_head.weight" in payload["state_dict"] and again.lm_head.weight is again.transformer.wte.weight


def test_sample_and_evaluate_serve_a_hugging_face_causal_lm(runs, capsys):
    run = str(runs / "gpt2")
    # 40 bytes of prompt > n_positions 32: the context slides over the model's own window.
    prompt = "def f(x):\n    return x + 1\n\nclass A:\n  "
    assert diloco(["sample", run, "--prompt", prompt, "--bytes", "6", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    want = generate(load_trained(run).model, list(prompt.encode()), max_new_tokens=6, temperature=0)
    assert out == (prompt.encode() + bytes(want)).decode("utf-8", errors="replace") + "\n"
    assert "checkpoint 7 (decoupled" in err

    assert diloco(["evaluate", run, "--set", "eval.batches=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("held-out loss ") and " nats/byte" in lines[1]
    loss = float(lines[1].split()[2])
    assert 0 < loss < 10, loss


def test_sampling_takes_any_encoder_and_a_run_tokenizer_file_is_the_hook(runs, tmp_path):
    class Shout:  # a toy tokenizer: upper-cased UTF-8 bytes in, bracketed text out
        def encode(self, text):
            return list(text.upper().encode())

        def decode(self, ids):
            return "[" + bytes(ids).decode("utf-8", errors="replace") + "]"

    model = load_trained(runs / "llama").model
    want = generate(model, list(b"AB"), max_new_tokens=3, temperature=0)
    assert sample_text(model, "ab", max_new_tokens=3, codec=Shout(), temperature=0) == \
        "[" + (b"AB" + bytes(want)).decode("utf-8", errors="replace") + "]"

    assert isinstance(run_text_codec(runs / "llama"), ByteText), "no tokenizer.json: bytes"
    (tmp_path / "tokenizer.json").write_text(json.dumps({"text_encoder": "bytes"}))  # islands.tokenizer's own file
    assert run_text_codec(tmp_path).encode("ab") == [97, 98]
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TrainedModelError, match=r"cannot read the run's tokenizer .*tokenizer.json \("):
        run_text_codec(tmp_path)


def test_a_cnn_exports_to_torch_with_its_batchnorm_statistics_and_is_refused_where_it_cannot_go(runs, tmp_path,
                                                                                                  capsys):
    run = str(runs / "cnn")
    trained = load_trained(run)
    assert diloco(["export", run, "--out", str(tmp_path / "cnn.pt")]) == 0
    capsys.readouterr()
    payload = torch.load(tmp_path / "cnn.pt", weights_only=True)
    assert payload["format"] == MODULE_EXPORT_FORMAT and payload["factory"] == CNN
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(payload["state_dict"])
    model = load_exported(tmp_path / "cnn.pt")
    assert not model.training
    for name in ("bn.running_mean", "bn.running_var"):
        assert torch.equal(model.state_dict()[name], trained.model.state_dict()[name]), name
    assert not torch.equal(model.bn.running_mean, torch.zeros(8)), "the trained statistics, not the fresh ones"
    images = cnn_batch(99)["image"]
    with torch.no_grad():
        assert torch.equal(model(images), trained.model(images))

    def refused(args, match):
        assert diloco(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err

    refused(["export", run, "--out", str(tmp_path / "cnn-hf"), "--format", "hf"],
            "is not a Hugging Face transformers.PreTrainedModel, so it has no Hugging Face folder; export it with "
            "--format torch")
    assert not (tmp_path / "cnn-hf").exists()
    refused(["sample", run, "--prompt", "x"], "diloco sample: SmallCNN is not a causal language model")
    refused(["evaluate", run], "trained on datasets passed to the Python API")


def test_export_refusals_name_the_fix(runs, tmp_path, capsys):
    gpt2 = load_trained(runs / "gpt2")
    folder = export_model(gpt2, tmp_path / "hf", format="hf")
    (folder / "stale.txt").write_text("from an older export")
    with pytest.raises(TrainedModelError, match="already exists; pass another path, or overwrite it"):
        export_model(gpt2, folder, format="hf")
    assert (folder / "stale.txt").is_file()
    export_model(gpt2, folder, format="hf", overwrite=True)  # a model folder is replaced whole
    assert {p.name for p in folder.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(TrainedModelError, match="holds files but no config.json"):
        export_model(gpt2, tmp_path / "notes", format="hf", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(TrainedModelError, match="is a folder; --format torch writes one file"):
        export_model(gpt2, folder, overwrite=True)
    with pytest.raises(TrainedModelError, match="is a folder .*from_pretrained"):
        load_exported(folder)
    with pytest.raises(TrainedModelError, match="unknown export format 'onnx'"):
        export_model(gpt2, tmp_path / "m.onnx", format="onnx")

    # The built-in byte transformer has no Hugging Face folder.
    run = tmp_path / "builtin"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"preset": "nano"}}))
    model = instantiate(model_recipe(build_config({"model": {"preset": "nano"}})).model, 0)
    CheckpointStore(run_checkpoint_uri(None, run)).save(
        1, {f"param/{n}": t.detach() for n, t in state_tensors(model).items()}, {"outer": {}, "extra": {}})
    assert diloco(["export", str(run), "--out", str(tmp_path / "b"), "--format", "hf"]) == 2
    assert capsys.readouterr().err == (
        "diloco export: the run's model (ByteTransformer) is not a Hugging Face transformers.PreTrainedModel, "
        "so it has no Hugging Face folder; export it with --format torch\n")
