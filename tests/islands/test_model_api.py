"""The model interface every engine path uses (islands/model_api.py): the loss, embeddings, tied weights, factories.

The built-in ByteTransformer must come out exactly as before (the loss bit for bit, the same embedding
names); a small LM of our own with its output head tied to its embedding shows the tied-weight rule:
one parameter in the fragment plan and the embedding names, still one tensor after the engine writes
adopted values into it.
"""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from islands.faults import InjectedFaults
from islands.fragment_state import FragmentState
from islands.inbox import Inbox
from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from islands.model_api import ModelError, default_loss, embedding_parameter_names, resolve_factory
from islands.outbox import LoopReadings, Outbox, OutboxSettings
from islands.trainer import InnerTrainer, forward_backward
from orchestrator.core.evaluation import Evaluator
from policies.adoption import parse_adoption
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config

HERE = "tests.islands.test_model_api"
NOT_CALLABLE = 42


class TiedLM(nn.Module):
    """A tiny causal LM whose output head shares its weight with the token embedding (as GPT-2 does)."""

    def __init__(self, vocab: int = 32, d: int = 8, head_first: bool = False) -> None:
        super().__init__()
        if head_first:  # registration order decides the name named_parameters() yields the shared tensor under
            self.lm_head = nn.Linear(d, vocab, bias=False)
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        if not head_first:
            self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lm_head(torch.tanh(self.mix(self.embed(idx))))}


def tiny_lm() -> nn.Module:
    """A factory an import path can name."""
    return TiedLM()


class Zoo:
    tiny = staticmethod(tiny_lm)


def returns_a_dict() -> dict:
    return {"not": "a model"}


def frozen_model() -> nn.Module:
    return nn.Linear(2, 2).requires_grad_(False)


def _batch(vocab: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (3, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------ the loss


def test_default_loss_is_bit_for_bit_the_byte_transformers_loss_and_gradients() -> None:
    x, y = _batch()
    model = build_model(model_config("nano"), seed=1)
    logits = model(x)
    old = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))  # ByteTransformer.loss as it was written
    old.backward()
    old_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    new = default_loss(model, (x, y))
    new.backward()
    assert new.dim() == 0 and torch.equal(new, old)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, old_grads[n]), n
    assert torch.equal(model.loss(x, y), old)  # the method delegates


def test_default_loss_reads_logits_from_an_output_object_or_dict() -> None:
    x, y = _batch(vocab=32)
    model = TiedLM()
    logits = model(x)["logits"]
    expected = F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
    assert torch.equal(default_loss(model, (x, y)), expected)

    class AsObject(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, idx: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(logits=self.inner(idx)["logits"])

    assert torch.equal(default_loss(AsObject(), [x, y]), expected)


def test_a_batch_with_labels_uses_the_models_own_loss_hugging_face_style() -> None:
    class HFStyle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(2.0))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.w * (input_ids - labels).float().mean(), "logits": torch.zeros(1)}

    batch = {"input_ids": torch.tensor([3, 5]), "labels": torch.tensor([1, 1])}
    assert default_loss(HFStyle(), batch).item() == pytest.approx(2.0 * 3.0)
    with pytest.raises(ModelError, match="needs 'labels'.*loss_fn="):
        default_loss(HFStyle(), {"input_ids": torch.tensor([3])})


def test_outputs_and_batches_the_default_loss_cannot_read_are_one_line_errors() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return idx, idx

    x, y = _batch()
    for call, pattern in [(lambda: default_loss(Pair(), (x, y)), "without a logits tensor"),
                          (lambda: default_loss(Pair(), x), "an \\(inputs, targets\\) pair")]:
        with pytest.raises(ModelError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value) and "loss_fn=" in str(err.value)


def test_a_user_loss_is_what_the_trainer_steps_on_and_the_evaluator_measures() -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def doubled(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(batch)
        return 2.0 * default_loss(model, batch)

    cfg = model_config("nano")
    data = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint8)
    settings = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=4)
    plain = InnerTrainer(cfg, data, settings=settings, shard_index=0, num_shards=1, seed=3)
    user = InnerTrainer(cfg, data, settings=settings, shard_index=0, num_shards=1, seed=3, loss_fn=doubled)
    assert user.step().loss == pytest.approx(2.0 * plain.step().loss, rel=1e-6)
    assert len(seen) == 1 and seen[0][0].shape == (4, cfg.seq_len)

    params = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    base = Evaluator(cfg, data, batches=2, batch_size=2).evaluate(params)[0]
    assert Evaluator(cfg, data, batches=2, batch_size=2, loss_fn=doubled).evaluate(params)[0] == pytest.approx(2 * base)


# ------------------------------------------------------------------ embeddings and tied weights


def test_embedding_names_of_the_byte_transformer_are_unchanged() -> None:
    model = build_model(model_config("nano"), seed=0)
    by_module_name = frozenset(f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, nn.Embedding)
                               for pn, _ in m.named_parameters(recurse=False))  # the method's former rule
    assert embedding_parameter_names(model) == by_module_name == frozenset({"tok_emb.weight", "pos_emb.weight"})
    assert model.embedding_parameter_names() == by_module_name


def test_a_bare_parameter_is_not_an_embedding() -> None:
    class BarePositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(4, 2)
            self.pos = nn.Parameter(torch.zeros(3, 2))

    assert embedding_parameter_names(BarePositions()) == frozenset({"tok.weight"})


@pytest.mark.parametrize("head_first", [False, True])
def test_a_tied_weight_is_one_parameter_in_the_plan_and_the_embedding_names(head_first: bool) -> None:
    model = TiedLM(head_first=head_first)
    shared = "lm_head.weight" if head_first else "embed.weight"
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert shared in initial and len(initial) == 3  # embed/lm_head (once), mix.weight, mix.bias
    # The driver's plan, from the same expression (orchestrator/run/driver.py build_world).
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], 2)
    planned = [n for frag in plan.fragments for n in frag]
    assert sorted(planned) == sorted(initial)
    unique_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert sum(t.numel() * t.element_size() for t in initial.values()) == unique_bytes
    assert embedding_parameter_names(model) == frozenset({shared})


def _inbox(model: nn.Module, plan, adoption: str) -> tuple[Inbox, FragmentState]:
    """An island's fragments over `model`'s live parameters and the inbox that writes adopted values into them."""
    params = dict(model.named_parameters())
    state = FragmentState.of([[params[n] for n in frag] for frag in plan.fragments])
    cv = threading.Condition()
    outbox = Outbox(OutboxSettings(island=0, incarnation=1, compression="none", compression_block_size=64,
                                   topk_density=0.01, feedback_decay=1.0), state, cv=cv, faults=InjectedFaults(0),
                    readings=lambda: LoopReadings(0.0, 0.0, 0))
    inbox = Inbox(island=0, adoption=parse_adoption(adoption), fragments=state, outbox=outbox, cv=cv,
                  device=torch.device("cpu"), resolve=lambda tensors: tensors,
                  hear_progress=lambda _: None)
    return inbox, state


@pytest.mark.parametrize("adoption", ["overwrite", "rebase", "mix(0.5)"])
def test_a_tied_weight_stays_tied_after_training_adoption_and_resync(adoption: str) -> None:
    model = TiedLM()
    names = [n for n, _ in model.named_parameters()]
    plan = plan_fragments([(n, p.numel() * 4) for n, p in model.named_parameters()], 2)
    inbox, state = _inbox(model, plan, adoption)

    def publish(version: int, scale: float) -> list[FragmentUpdate]:
        g = torch.Generator().manual_seed(version)
        values = {n: scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        return [FragmentUpdate(p, version, [[values[n] for n in frag]]) for p, frag in enumerate(plan.fragments)]

    def assert_tied() -> None:
        assert model.lm_head.weight is model.embed.weight
        assert [n for n, _ in model.named_parameters()] == names

    first = publish(0, 1.0)
    for u in first:
        inbox.queue(u)
    assert inbox.apply_updates() == {0, 1}
    assert_tied()
    p_emb = next(p for p, frag in enumerate(plan.fragments) if "embed.weight" in frag)
    adopted = first[p_emb].tensors[0][plan.fragments[p_emb].index("embed.weight")]
    assert torch.equal(model.lm_head.weight, adopted)  # the first adoption writes the global values as they are

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # local progress, so the next adoption has something to keep
    x, y = _batch(vocab=32)
    forward_backward(model, (x, y), precision="fp32")
    opt.step()
    state.count_step(tokens=int(x.numel()), wall_s=0.0)
    for u in publish(1, 1.5):
        inbox.queue(u)
    inbox.apply_updates()
    assert_tied()
    assert torch.equal(model.embed.weight, state.theta[p_emb][plan.fragments[p_emb].index("embed.weight")])

    # The outer optimizer went back to a checkpoint: the island force-adopts its whole state.
    again = publish(2, 0.5)
    inbox.resync(again)
    inbox.apply_updates()
    assert_tied()
    assert torch.equal(model.lm_head.weight, again[p_emb].tensors[0][plan.fragments[p_emb].index("embed.weight")])


# ------------------------------------------------------------------ factories


def test_a_factory_is_a_callable_or_an_import_path_and_every_model_it_builds_is_checked() -> None:
    by_path = resolve_factory(f"{HERE}:tiny_lm")
    assert by_path.spec == f"{HERE}:tiny_lm" and isinstance(by_path(), TiedLM)
    assert isinstance(resolve_factory(TiedLM)(), TiedLM)  # a class taking no arguments is a factory too
    assert resolve_factory(by_path) is by_path
    assert isinstance(resolve_factory(f"{HERE}:Zoo.tiny")(), TiedLM)  # a dotted attribute path resolves
    again = pickle.loads(pickle.dumps(by_path))  # what reaches an island process
    assert again.spec == by_path.spec and isinstance(again(), TiedLM)


@pytest.mark.parametrize(("spec", "pattern"), [
    ("no_such_package.models:build", "cannot import module 'no_such_package.models'.*PYTHONPATH"),
    (f"{HERE}:missing", "has no attribute 'missing'.*package.module:function"),
    (f"{HERE}:NOT_CALLABLE", "is an object of type int, not a callable; point it at a function"),
    ("islands.model_api", "not an import path; write it as 'package.module:function'"),
    (42, "a callable or an import path"),
])
def test_a_factory_that_does_not_resolve_is_a_one_line_error(spec: object, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern) as err:
        resolve_factory(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "pattern"), [
    ("returns_a_dict", "returned a dict, not a torch.nn.Module; make it return the model itself"),
    ("frozen_model", "has no trainable parameters; give it parameters with requires_grad=True"),
])
def test_a_factory_whose_model_does_not_fit_is_a_one_line_error_naming_it(name: str, pattern: str) -> None:
    factory = resolve_factory(f"{HERE}:{name}")
    with pytest.raises(ModelError, match=pattern) as err:
        factory()
    assert f"'{HERE}:{name}'" in str(err.value) and "\n" not in str(err.value)
