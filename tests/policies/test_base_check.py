"""The stale-base check's digest and record (policies/base_check.py), without Ray."""

from __future__ import annotations

import pytest
import torch

from policies.base_check import DIGEST_SAMPLES, BaseDigests, fragment_digest


def _frag(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 64, generator=gen), torch.randn(3 * DIGEST_SAMPLES + 7, generator=gen)]


def test_equal_tensors_give_equal_digests_whatever_their_layout():
    a = _frag()
    copy = [t.clone() for t in a]
    strided = [a[0].t().contiguous().t(), a[1]]  # same values, another memory layout
    assert fragment_digest(a) == fragment_digest(copy) == fragment_digest(strided)


def test_a_moved_base_a_reshaped_one_and_one_changed_element_in_the_sample_differ():
    a = _frag()
    moved = [t - 1e-3 * torch.sign(t) for t in a]  # an outer step moves every element a little
    assert fragment_digest(moved) != fragment_digest(a)
    assert fragment_digest([a[0].reshape(32, 128), a[1]]) != fragment_digest(a)
    one = [a[0].clone(), a[1].clone()]
    one[1][0] = torch.nextafter(one[1][0], torch.tensor(float("inf")))  # element 0 is always read: one ulp
    assert fragment_digest(one) != fragment_digest(a)


def test_the_record_keeps_the_last_versions_and_judges_only_what_it_knows():
    d = BaseDigests(2, keep=3)
    for v in range(5):
        d.record(0, v, f"digest-{v}")
    assert [d.knows(0, v) for v in range(5)] == [False, False, True, True, True]
    assert d.problem(0, 4, "digest-4") is None
    reason = d.problem(0, 4, "digest-2")
    assert reason is not None and "not version 4 of fragment 0" in reason and "digest-2" in reason
    assert d.problem(0, 1, "anything") is None  # forgotten (too stale to matter): not judged
    assert d.problem(1, 4, "digest-2") is None  # another fragment: nothing recorded
    assert d.problem(0, 4, None) is None  # an island that tells no digest (FSDP parts)


def test_a_record_that_keeps_nothing_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="keep must be >= 1"):
        BaseDigests(1, keep=0)
