"""Inner-step arithmetic (islands/trainer.py `forward_backward`, config field inner.precision), on CPU.

TF32 is a GPU matmul mode: on CPU it must change nothing, bit for bit. bf16 runs the forward pass
under autocast: the layers' outputs must really be bfloat16 while weights, gradients and AdamW state
stay fp32, and training must track fp32 closely (not exactly: if it matched bit for bit, autocast
would not be on). The GPU side of both is checked by benchmarks/gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from islands.model import model_config
from islands.trainer import InnerTrainer, forward_backward
from tests.from_config import inner_from_config

CFG = model_config("nano")


def _data() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.choice(256, size=40_000, p=np.r_[np.full(16, 0.05), np.full(240, 0.2 / 240)]).astype(np.uint8)


def _train(precision: str, steps: int) -> tuple[list[float], InnerTrainer]:
    t = InnerTrainer(CFG, _data(), settings=inner_from_config(lr=3e-3, warmup_steps=2, batch_size=8, precision=precision),
                     shard_index=0, num_shards=1, seed=3)
    return [t.step().loss for _ in range(steps)], t


def test_tf32_on_cpu_is_fp32_bit_for_bit():
    fp32_losses, fp32 = _train("fp32", 5)
    tf32_losses, tf32 = _train("tf32", 5)
    assert tf32_losses == fp32_losses
    for name, p in fp32.params.items():
        assert torch.equal(p, tf32.params[name]), name
    assert torch.backends.cuda.matmul.allow_tf32 is False, "the step must not leave TF32 switched on for the process"


def test_bf16_autocasts_the_forward_and_keeps_weights_gradients_and_state_fp32():
    t = InnerTrainer(CFG, _data(), settings=inner_from_config(batch_size=8, precision="bf16"), shard_index=0,
                     num_shards=1, seed=3)
    seen: list[torch.dtype] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
             for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
    x, y = t.sampler.next_batch()
    loss = forward_backward(t.model, (x, y), precision="bf16")
    for h in hooks:
        h.remove()
    # Every linear layer in bf16, except the output head, which stays fp32 (low losses need its precision).
    assert len(seen) == len(hooks) and seen[:-1] and set(seen[:-1]) == {torch.bfloat16} and seen[-1] == torch.float32, seen
    assert loss.dtype == torch.float32  # cross-entropy runs in fp32 under autocast
    for name, p in t.params.items():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    t.optimizer.step()
    assert all(v.dtype == torch.float32 for s in t.optimizer.state.values() for v in s.values() if v.is_floating_point())


def test_bf16_training_tracks_fp32_without_matching_it():
    fp32, _ = _train("fp32", 40)
    bf16, _ = _train("bf16", 40)
    assert bf16 != fp32, "bit-identical losses: autocast did not engage"
    assert bf16[-1] < 0.8 * bf16[0] and fp32[-1] < 0.8 * fp32[0]
    # bf16 has 8 bits of mantissa: per-step losses stay within 1% of fp32's (measured: 0.014%).
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 0.01


def test_unknown_precision_is_refused_with_the_choices():
    t = InnerTrainer(CFG, _data(), settings=inner_from_config(batch_size=2), shard_index=0, num_shards=1, seed=3)
    x, y = t.sampler.next_batch()
    with pytest.raises(ValueError, match=r"precision='fp16'; use one of fp32, tf32, bf16"):
        forward_backward(t.model, (x, y), precision="fp16")
    assert all(p.grad is None for p in t.model.parameters()), "a refused call computes nothing"
