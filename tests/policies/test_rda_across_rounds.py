"""RDA's norm rule across partial rounds (policies.merge.RdaAcrossRounds): a float64 numpy reference,
the limits it is built to reproduce (aligned -> 1, orthogonal -> RDA's factor), full rounds untouched,
and a checkpoint round trip that continues exactly."""

import math

import numpy as np
import pytest
import torch

from policies.merge import RdaAcrossRounds, rda_merge


def _reference(rounds, decay=2.0):
    """Independent float64 loop: rounds = [(share, [array per tensor])] -> factors per round per tensor."""
    norms, sums, out = None, None, []
    for share, grads in rounds:
        a = math.exp(-decay * share)
        if norms is None:
            norms = [0.0] * len(grads)
            sums = [np.zeros_like(np.asarray(g, dtype=np.float64)) for g in grads]
        row = []
        for t, g in enumerate(grads):
            g = np.asarray(g, dtype=np.float64)
            norms[t] = a * norms[t] + share * np.linalg.norm(g)
            sums[t] = a * sums[t] + share * g
            row.append(min(1.0 / math.sqrt(share), max(1.0, norms[t] / np.linalg.norm(sums[t]))))
        out.append(row)
    return out


def test_hand_example():
    w = RdaAcrossRounds(1, [True])
    assert w.update([torch.tensor([3.0, 4.0])], 0.5) == [1.0]  # one round: nothing to average yet
    a = math.exp(-1.0)
    # N = 2.5a + 0.5*2; V = a*[1.5, 2] + [0, 1]
    expected = (2.5 * a + 1.0) / math.hypot(1.5 * a, 2 * a + 1.0)  # 1.1549
    assert w.update([torch.tensor([0.0, 2.0])], 0.5) == [pytest.approx(expected, rel=1e-6)]


def test_matches_reference_on_random_rounds():
    gen = torch.Generator().manual_seed(0)
    rounds = [(s, [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen) * 3])
              for s in (0.25, 0.5, 0.25, 0.25, 0.75, 0.25, 0.5, 0.25)]
    w = RdaAcrossRounds(2, [True, True])
    got = [w.update(g, s) for s, g in rounds]
    ref = _reference([(s, [g.numpy() for g in gs]) for s, gs in rounds])
    assert np.allclose(got, ref, rtol=1e-5)
    assert max(max(r) for r in got) > 1.2  # random directions: the rule does lengthen


def test_aligned_rounds_get_one():
    w = RdaAcrossRounds(1, [True])
    g = torch.tensor([1.0, -2.0, 0.5])
    factors = [w.update([g * k], 0.25)[0] for k in (1.0, 3.0, 0.5, 2.0)]
    assert factors == pytest.approx([1.0] * 4, abs=1e-6)


def test_orthogonal_stream_matches_rda_in_one_round():
    # RDA over four orthogonal deltas of equal norm lengthens their mean 2x; four rounds of share 1/4,
    # one delta each, should be lengthened about as much once the window is full.
    basis = torch.eye(64)[:, :40].T.contiguous()  # 40 orthonormal rows
    mean = sum(basis[:4]) / 4
    assert float(rda_merge(list(basis[:4]), [0.25] * 4).norm() / mean.norm()) == pytest.approx(2.0)
    w = RdaAcrossRounds(1, [True])
    factors = [w.update([basis[i]], 0.25)[0] for i in range(40)]
    assert factors[0] == 1.0
    assert factors[-1] == pytest.approx(2.0, rel=0.03)
    assert all(f <= 2.0 for f in factors)  # the cap 1 / sqrt(share)


def test_full_rounds_unchanged_and_hold_nothing():
    w = RdaAcrossRounds(2, [True, True])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        assert w.update([torch.randn(3, generator=gen), torch.randn(2, generator=gen)], 1.0) == [1.0, 1.0]
    assert not w.active  # K = all keeps no window
    w.update([torch.tensor([1.0, 0, 0]), torch.tensor([1.0, 0])], 0.25)
    assert w.active
    assert w.update([torch.tensor([0, 1.0, 0]), torch.tensor([0, 1.0])], 1.0) == [1.0, 1.0]  # capped at 1


def test_untracked_tensors_get_one():
    w = RdaAcrossRounds(2, [False, True])
    w.update([torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])], 0.25)
    f = w.update([torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])], 0.25)
    assert f[0] == 1.0 and f[1] > 1.1
    assert w.state_dict()["sums"][0] is None


def test_state_round_trip_continues_exactly():
    gen = torch.Generator().manual_seed(2)
    rounds = [[torch.randn(4, 3, generator=gen)] for _ in range(8)]
    whole = RdaAcrossRounds(1, [True])
    expected = [whole.update(g, 0.25) for g in rounds]
    first = RdaAcrossRounds(1, [True])
    for g in rounds[:5]:
        first.update(g, 0.25)
    state = first.state_dict()
    first.update([torch.ones(4, 3)], 0.25)  # later updates must not reach the saved state
    resumed = RdaAcrossRounds(1, [True])
    resumed.load_state_dict(state)
    assert [resumed.update(g, 0.25) for g in rounds[5:]] == expected[5:]


@pytest.mark.parametrize("bad, match", [
    (lambda w: w.update([torch.ones(2)], 0.0), "share=0.0 must be in"),
    (lambda w: w.update([torch.ones(2)], 1.5), "share=1.5 must be in"),
    (lambda w: w.update([torch.ones(2), torch.ones(2)], 0.5), "2 tensors but the tracker has 1"),
    (lambda w: w.load_state_dict({"norms": [], "sums": []}), "0 norms and 0 sums for 1 tensors"),
])
def test_bad_input_is_refused(bad, match):
    w = RdaAcrossRounds(1, [True])
    with pytest.raises(ValueError, match=match):
        bad(w)
    assert w.update([torch.ones(2)], 0.5) == [1.0]  # nothing changed


def test_shape_change_is_refused_and_changes_nothing():
    w = RdaAcrossRounds(2, [True, True])
    w.update([torch.ones(2), torch.ones(2)], 0.5)
    before = w.state_dict()
    with pytest.raises(ValueError, match=r"outer_grad\[1\] has shape \(3,\) but the tracker holds \(2,\)"):
        w.update([torch.ones(2), torch.ones(3)], 0.5)
    after = w.state_dict()
    assert after["norms"] == before["norms"]
    assert all(torch.equal(a, b) for a, b in zip(after["sums"], before["sums"]))
