"""islands.sampling.generate: greedy, temperature, top-k, the sliding context and its input checks."""

from __future__ import annotations

import math

import pytest
import torch

from islands.model import build_model, model_config
from islands.sampling import generate


def rigged(logits: dict[int, float], floor: float = -50.0):
    """A nano model whose next-id logits are `logits` (others `floor`) whatever the input.

    The final LayerNorm's weight is zeroed and its bias set to the first unit vector, so every position's
    last hidden state is e_0 and the logits are the head's first column.
    """
    model = build_model(model_config("nano"), seed=0)
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.zero_()
        model.ln_f.bias[0] = 1.0
        column = torch.full((model.cfg.vocab_size,), floor)
        for i, v in logits.items():
            column[i] = v
        model.lm_head.weight[:, 0] = column
    return model


def frequencies(ids: list[int], of: list[int]) -> list[float]:
    return [ids.count(i) / len(ids) for i in of]


def test_greedy_takes_the_likeliest_id_every_time():
    model = rigged({65: 3.0, 66: 2.9})
    assert generate(model, [1, 2, 3], max_new_tokens=20, temperature=0) == [65] * 20
    # top_k=1 is greedy whatever the temperature.
    assert generate(model, [1], max_new_tokens=5, temperature=5.0, top_k=1) == [65] * 5


def test_draws_follow_the_model_distribution_sharpened_by_temperature_and_cut_by_top_k():
    p = {10: 0.5, 20: 0.3, 30: 0.2}
    model = rigged({i: math.log(q) for i, q in p.items()})
    n = 3000
    tol = 4 * math.sqrt(0.25 / n)  # four standard deviations of a frequency near 0.5

    got = frequencies(generate(model, [0], max_new_tokens=n, temperature=1.0, seed=1), [10, 20, 30])
    assert got == pytest.approx([0.5, 0.3, 0.2], abs=tol)

    # Temperature 0.5 squares the probabilities before renormalizing.
    sq = [q * q for q in p.values()]
    got = frequencies(generate(model, [0], max_new_tokens=n, temperature=0.5, seed=2), [10, 20, 30])
    assert got == pytest.approx([q / sum(sq) for q in sq], abs=tol)

    # top_k=2 keeps 10 and 20 only, in their ratio.
    ids = generate(model, [0], max_new_tokens=n, temperature=1.0, top_k=2, seed=3)
    assert set(ids) == {10, 20}
    assert frequencies(ids, [10]) == pytest.approx([0.5 / 0.8], abs=tol)


def test_a_seed_gives_the_same_text_and_leaves_the_global_rng_alone():
    model = rigged({})  # uniform over all 256 ids
    state = torch.get_rng_state()
    a = generate(model, [5], max_new_tokens=50, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert generate(model, [5], max_new_tokens=50, seed=7) == a
    assert generate(model, [5], max_new_tokens=50, seed=8) != a
    assert len(set(a)) > 20  # uniform draws, not a constant


def test_only_the_newest_seq_len_ids_condition_the_next_one():
    model = build_model(model_config("nano"), seed=3)  # seq_len 32
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (50,), generator=g).tolist()
    # Longer than the context, and generating past it: only the last 32 ids of the prompt can matter.
    out = generate(model, prompt, max_new_tokens=40, temperature=0)
    assert out == generate(model, prompt[-32:], max_new_tokens=40, temperature=0)
    assert out != generate(model, prompt[-31:], max_new_tokens=40, temperature=0)
    # Each id is the argmax of the model on the 32 ids before it.
    ctx = prompt + out
    for i in (0, 17, 39):
        window = torch.tensor(ctx[50 + i - 32:50 + i])[None]
        assert out[i] == int(model(window)[0, -1].argmax())


def test_the_training_flag_is_restored():
    model = build_model(model_config("nano"), seed=0)
    model.train()
    generate(model, [1], max_new_tokens=2)
    assert model.training
    model.eval()
    generate(model, [1], max_new_tokens=2)
    assert not model.training


@pytest.mark.parametrize("kwargs, match", [
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [256]}, r"id 256 outside \[0, 256\)"),
    ({"max_new_tokens": -1}, "max_new_tokens=-1"),
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_k": 0}, "top_k=0"),
    ({"top_k": 257}, "top_k=257"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, match):
    model = build_model(model_config("nano"), seed=0)
    args = {"prompt": [1], "max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        generate(model, args.pop("prompt"), **args)
    assert "\n" not in str(err.value)
