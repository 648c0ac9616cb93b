"""Degenerate settings reproduce known algorithms (docs/architecture.md section 3), composed from the policies."""

import math

import torch

from policies.adoption import adopt_fragment, parse_adoption
from policies.fragments import plan_fragments
from policies.merge import merge_fragment
from policies.outer_optimizer import FragmentOuterOptimizer
from policies.quorum import decide_round, grace_window_s
from policies.weighting import merge_weights


def test_synchronous_diloco_two_outer_steps():
    # K = M = 3, infinite grace, uniform weights, mean merge, P = 1, overwrite.
    gen = torch.Generator().manual_seed(0)
    plan = plan_fragments([("w", 24), ("b", 8)], 1)
    assert plan.fragments == (("w", "b"),)
    theta = [torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen)]
    islands = [[t.clone() for t in theta] for _ in range(3)]
    opt = FragmentOuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    grace = grace_window_s(
        gamma=math.inf, tau_steps=1, step_time_s=1.0, quorum_time_s=0.0, sync_time_s=0.0, cap_s=math.inf
    )
    ref_theta = [t.double().clone() for t in theta]
    ref_buf = [torch.zeros_like(t) for t in ref_theta]

    for _ in range(2):
        for local in islands:  # inner training: each island drifts its own way
            for t in local:
                t.add_(0.1 * torch.randn(t.shape, generator=gen))
        # The round closes only once all three are in, however long it has waited.
        for pending in (1, 2):
            decision = decide_round(
                now=1e6, pending=pending, min_quorum=3, live_islands=3, quorum_reached_at=0.0, grace_s=grace
            )
            assert not decision.close
        all_in = decide_round(now=0.0, pending=3, min_quorum=3, live_islands=3, quorum_reached_at=0.0, grace_s=grace)
        assert all_in.close

        deltas = [[g - t for g, t in zip(theta, local)] for local in islands]
        w = merge_weights(tokens=[10, 500, 7], steps=[1, 2, 3], scheme="uniform")
        opt.step(merge_fragment(deltas, w, rule="mean", embedding_mask=[False, False]))

        # Reference DiLoCo outer step, written out: g = mean_m(theta - theta_m), then Nesterov SGD.
        for k in range(2):
            g = sum(ref_theta[k] - local[k].double() for local in islands) / 3
            ref_buf[k] = 0.9 * ref_buf[k] + g
            ref_theta[k] = ref_theta[k] - 0.7 * (g + 0.9 * ref_buf[k])

        islands = [
            adopt_fragment(parse_adoption("overwrite"), local=local, anchor=theta, global_=theta) for local in islands
        ]

    for got, want in zip(theta, ref_theta):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for local in islands:  # every island restarts from the global parameters
        assert all(torch.equal(a, b) for a, b in zip(local, theta))
