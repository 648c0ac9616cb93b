"""What the engine keeps of a user's model: tied weights once and tied, trained buffers by the mean rule.

Real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from islands.model_api import buffer_names, embedding_parameter_names, instantiate, state_tensors
from islands.spec import ModelRecipe
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.core.round_merge import merge_round
from policies.fragments import plan_fragments
from policies.outer_optimizer import FragmentOuterOptimizer
from tests.api import zoo
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=3e-3, warmup_steps=0, batch_size=2)


def _world(factory, *, fragments: int = 2, seed: int = 1):
    recipe = ModelRecipe(model=factory, loss=None, optimizer=None, seed=seed, seq_len=zoo.SEQ)
    model = instantiate(factory, seed)
    init = {n: t.detach().clone() for n, t in state_tensors(model).items()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], fragments)
    outer = OuterOptimizer(init, plan, settings=outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0),
                           embedding_names=embedding_parameter_names(model), buffer_names=set(buffer_names(model)))
    return recipe, plan, outer


def _island(recipe, plan, outer, island: int, data, incarnation: int = 1) -> LearnerIsland:
    spec = spec_from_config(model_config=None, plan=plan, island=island, incarnation=incarnation, pool="p",
                            num_islands=2, inner=INNER, sync_every_steps=4, seed=1, adoption="overwrite")
    spec = dataclasses.replace(spec, model=recipe)
    outer.register(island, incarnation)
    latest = [FragmentUpdate(p, outer.versions[p], [outer.fragment(p)]) for p in range(plan.num_fragments)]
    return LearnerIsland(spec, data, latest)


def _run_rounds(islands, outer, rounds: int) -> int:
    done = 0
    while done < rounds:
        for island in islands:
            island.step()
            while (sub := island.next_submission(0)) is not None:
                got, refusal = outer.receive(sub, now=0.0)
                assert refusal is None
                done += len(got)
                for r in got:
                    for other in islands:
                        other.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
    return done


def test_a_tied_weight_is_one_tensor_of_the_plan_sent_once_and_stays_tied_after_adoptions_and_a_restart():
    pytest.importorskip("transformers")
    recipe, plan, outer = _world(zoo.tiny_gpt2)
    names = [n for frag in plan.fragments for n in frag]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names, "tied: one entry, under its first name"
    assert len(names) == len(set(names))
    data = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint8)
    islands = [_island(recipe, plan, outer, i, data) for i in range(2)]
    assert _run_rounds(islands, outer, rounds=3) >= 3
    wte = outer.global_parameters()["transformer.wte.weight"]
    for island in islands:
        model = island.trainer.model
        assert model.lm_head.weight is model.transformer.wte.weight
    # A restarted island (a new incarnation from the latest global state) is tied and holds the global weight.
    again = _island(recipe, plan, outer, 0, data, incarnation=2)
    model = again.trainer.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight.detach(), wte)


def _subs_for(p: int, deltas: list[list[torch.Tensor]], tokens: list[int]):
    """Pending entries (submission, staleness, deltas) as merge_round takes them, one per island."""
    from islands.messages import Submission

    subs = []
    for i, (d, t) in enumerate(zip(deltas, tokens)):
        sub = Submission(island=i, incarnation=1, seq=p, fragment=p, base_version=0, tokens=t, inner_steps=4,
                         step_time_s=0.1, train_loss=1.0, payload=[])
        subs.append((sub, 0, d))
    return subs


def test_a_trained_buffer_moves_to_the_islands_weighted_mean_while_parameters_take_the_nesterov_step():
    settings = outer_from_config(lr=0.7, momentum=0.9, merge_rule="rda", weighting="tokens")
    param, buffer = torch.zeros(3), torch.full((3,), 1.0)
    opt = FragmentOuterOptimizer([param, buffer], lr=settings.lr, momentum=settings.momentum)
    # Island deltas (base - local): buffers' local values are 1 - delta, i.e. 0.2 and 0.6 below.
    deltas = [[torch.tensor([1.0, 0.0, 0.0]), torch.full((3,), 0.8)],
              [torch.tensor([0.0, 1.0, 0.0]), torch.full((3,), 0.4)]]
    tokens = [300, 100]  # weights tokens*tokens/steps: 22500 and 2500 -> 0.9 and 0.1
    for _ in range(2):  # the second round: momentum exists, a buffer still takes no part in it
        before = buffer.clone()
        merge_round(_subs_for(0, deltas, tokens), opt=opt, window=None, settings=settings,
                    embedding_mask=[False, True], buffer_mask=[False, True], live_islands=2, final=False)
        mean_delta = 0.9 * 0.8 + 0.1 * 0.4  # plain token-weighted mean: no lr, no momentum, no RDA lengthening
        torch.testing.assert_close(buffer, before - mean_delta, rtol=0, atol=1e-6)
    assert float(param.abs().sum()) > 0  # the parameter moved by the outer step
    # Momentum was never built for the buffer: its SGD state is zero.
    buf_state = opt.momentum_buffers()[1]
    assert buf_state is None or float(buf_state.abs().max()) == 0.0


def test_buffers_rule_names_persistent_float_buffers_only():
    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)
            self.register_buffer("mask", torch.ones(4), persistent=False)
            self.lin = torch.nn.Linear(4, 4)

    model = WithMask()
    assert buffer_names(model) == ["bn.running_mean", "bn.running_var"]  # not num_batches_tracked (int), not mask
    state = state_tensors(model)
    assert list(state)[-2:] == ["bn.running_mean", "bn.running_var"]
    assert state["bn.running_mean"] is model.bn.running_mean  # the model's own tensor: adoption writes into it
