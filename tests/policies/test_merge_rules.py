"""The plug-in machinery of merge rules and compressors (policies/merge_rules.py, policies/compressor.py,
policies/plugin_registry.py): registration, the Column a rule reads, and the flags the round reads."""

from __future__ import annotations

import uuid

import pytest
import torch

from policies.compression import compress, compressor
from policies.merge import merge_into, rules_per_tensor
from policies.merge_rules import Column, MeanRule, MergeRule, RdaRule, merge_rule, register_merge_rule
from policies.plugin_registry import Registry


class _Last(MergeRule):
    """The last island's value: a rule whose result shows which entry it read."""

    def merge_into(self, out, column, weights):
        return out.copy_(column.value(len(column) - 1))


def test_a_registered_rule_is_found_by_name_and_a_name_is_taken_once():
    name = f"test-last-{uuid.uuid4().hex}"  # the registry is process-wide: a name of this run's own
    rule = register_merge_rule(name, _Last())
    assert merge_rule(name) is rule and register_merge_rule(name, rule) is rule
    with pytest.raises(ValueError, match=f"'{name}' is already registered"):
        register_merge_rule(name, _Last())
    with pytest.raises(ValueError, match="is a str, not a policies.merge_rules.MergeRule"):
        register_merge_rule("test-str", "mean")  # type: ignore[arg-type]
    out = merge_into(torch.empty(3), [torch.ones(3), torch.full((3,), 2.0)], [0.5, 0.5], rule=name)
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_an_unknown_name_says_what_exists_in_one_line():
    registry: Registry[MergeRule] = Registry("merge rule", MergeRule, "'package.module:Name'")
    registry.register("a", MeanRule())
    with pytest.raises(ValueError, match=r"^unknown merge rule 'b'; use one of a or an import path 'package.module:Name'$"):
        registry.get("b")


def test_the_column_decodes_each_entry_once_and_uses_known_norms():
    calls = []

    def decode(c, scratch):
        calls.append(c)
        return torch.full(c.shape, 3.0)

    wire = compress(torch.ones(2), "bf16")
    column = Column([torch.tensor([3.0, 4.0]), wire], [None, 7.0], decode=decode)
    assert column.norm(0) == 5.0 and column.norm(1) == 7.0 and calls == [], "a known norm decodes nothing"
    assert column.value(1).tolist() == [3.0, 3.0] and column.value(1).tolist() == [3.0, 3.0]
    assert calls == [wire], "norm() then value() of one entry decodes it once"
    with pytest.raises(ValueError, match="needs decode="):
        Column([wire]).value(0)


def test_the_flags_the_round_reads():
    rda, mean, last = merge_rule("rda"), merge_rule("mean"), _Last()
    assert isinstance(rda, RdaRule) and rda.across_rounds and not mean.across_rounds and not last.across_rounds
    # Embeddings take the mean under rules that say so; trained buffers always do.
    assert rules_per_tensor("rda", [False, True, True], [False, False, True]) == [rda, mean, mean]
    last.mean_for_embeddings = False
    assert rules_per_tensor(last, [False, True, True], [False, False, True]) == [last, last, mean]


def test_the_built_in_compressors_describe_themselves():
    flags = {n: (compressor(n).dense, compressor(n).needs_feedback, compressor(n).blocked, compressor(n).uses_density,
                 compressor(n).decodes_in_place) for n in ("none", "bf16", "int8", "int4", "int2", "sign", "topk")}
    assert flags == {"none": (True, False, False, False, False), "bf16": (True, False, False, False, False),
                     "int8": (True, False, True, False, True), "int4": (True, False, True, False, True),
                     "int2": (False, True, True, False, False), "sign": (False, True, True, False, False),
                     "topk": (False, True, False, True, False)}
