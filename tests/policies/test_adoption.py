"""Adoption policies: parsing, hand values per kind, and that inputs are never written."""

import pytest
import torch

from policies.adoption import AdoptionPolicy, adopt_fragment, parse_adoption


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("overwrite", AdoptionPolicy("overwrite")),
        (" rebase ", AdoptionPolicy("rebase")),
        ("mix(0.5)", AdoptionPolicy("mix", 0.5)),
        ("mix ( 0.25 )", AdoptionPolicy("mix", 0.25)),
        ("mix(0)", AdoptionPolicy("mix", 0.0)),
    ],
)
def test_parse(spec, expected):
    assert parse_adoption(spec) == expected


@pytest.mark.parametrize(
    "spec", ["", "Overwrite", "mix", "mix()", "mix(1)", "mix(-0.1)", "mix(a)", "mix(0.5", "rebase(0.5)"]
)
def test_parse_errors_name_valid_forms(spec):
    with pytest.raises(ValueError, match=r"'overwrite', 'rebase' or 'mix\(alpha\)'|adoption alpha must be in"):
        parse_adoption(spec)


def test_str_round_trips():
    for spec in ("overwrite", "rebase", "mix(0.3)"):
        assert parse_adoption(str(parse_adoption(spec))) == parse_adoption(spec)


def test_policy_validation():
    with pytest.raises(ValueError, match="unknown adoption kind 'keep'"):
        AdoptionPolicy("keep")
    with pytest.raises(ValueError, match="alpha=0.5 only applies to 'mix'"):
        AdoptionPolicy("rebase", 0.5)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\), got 1.0"):
        AdoptionPolicy("mix", 1.0)


def _fragment():
    local = [torch.tensor([1.0, 2.0]), torch.tensor([[10.0]])]
    anchor = [torch.tensor([0.5, 0.5]), torch.tensor([[4.0]])]
    global_ = [torch.tensor([3.0, -1.0]), torch.tensor([[7.0]])]
    return local, anchor, global_


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("overwrite", [[3.0, -1.0], [[7.0]]]),
        # global + (local - anchor): [3 + 0.5, -1 + 1.5], [[7 + 6]]
        ("rebase", [[3.5, 0.5], [[13.0]]]),
        # 0.25 * local + 0.75 * global: [0.25 + 2.25, 0.5 - 0.75], [[2.5 + 5.25]]
        ("mix(0.25)", [[2.5, -0.25], [[7.75]]]),
    ],
)
def test_hand_values(spec, expected):
    local, anchor, global_ = _fragment()
    out = adopt_fragment(parse_adoption(spec), local=local, anchor=anchor, global_=global_)
    assert [t.tolist() for t in out] == expected


@pytest.mark.parametrize("spec", ["overwrite", "rebase", "mix(0.5)"])
def test_inputs_untouched_and_outputs_fresh(spec):
    local, anchor, global_ = _fragment()
    snapshot = [[t.clone() for t in group] for group in (local, anchor, global_)]
    out = adopt_fragment(parse_adoption(spec), local=local, anchor=anchor, global_=global_)
    for group, saved in zip((local, anchor, global_), snapshot):
        for t, s in zip(group, saved):
            assert torch.equal(t, s)
    for o in out:
        for t in (*local, *anchor, *global_):
            assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    out[0].add_(100.0)  # writing the result must not reach the (possibly shared) global tensors
    assert torch.equal(global_[0], snapshot[2][0])


def test_output_dtype_follows_local():
    local = [torch.tensor([1.0, 2.0], dtype=torch.bfloat16)]
    global_ = [torch.tensor([0.5, 0.25])]
    for spec in ("overwrite", "rebase", "mix(0.5)"):
        out = adopt_fragment(parse_adoption(spec), local=local, anchor=[torch.zeros(2)], global_=global_)
        assert out[0].dtype == torch.bfloat16


def test_rebase_with_anchor_equal_local_is_overwrite():
    local, _, global_ = _fragment()
    out = adopt_fragment(parse_adoption("rebase"), local=local, anchor=local, global_=global_)
    assert all(torch.equal(o, g) for o, g in zip(out, global_))


def test_mismatch_errors():
    local, anchor, global_ = _fragment()
    with pytest.raises(ValueError, match="local has 2 tensors, anchor 2, global_ 1"):
        adopt_fragment(parse_adoption("overwrite"), local=local, anchor=anchor, global_=global_[:1])
    with pytest.raises(ValueError, match=r"tensor 1: local \(1, 1\), anchor \(1, 1\), global_ \(2,\)"):
        adopt_fragment(parse_adoption("rebase"), local=local, anchor=anchor, global_=[global_[0], torch.zeros(2)])
