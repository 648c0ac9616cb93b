"""A user's merge rule and compressor from modules outside the package (examples/extending/trimmed_mean.py,
tests/plugins/user_plugins.py), named by import path through the config (``--set outer.merge_rule=pkg.mod:Name``,
``outer.compression``), train through the real in-process engine core: LearnerIslands and the OuterOptimizer core, stepped without Ray.

What shows the plug-ins were used: every submission is on the user's wire (float16 under its import path), and
each round's new global fragment is the trimmed mean of exactly those decoded submissions, a hand computation
that the built-in mean misses on a crafted outlier. What cannot be loaded is one ConfigError line.
"""

from __future__ import annotations

import pytest
import torch

from examples.extending.trimmed_mean import TrimmedMean
from islands.island import LearnerIsland
from islands.messages import FragmentUpdate, Submission
from islands.model_api import ModelError
from islands.plugins import load_compressor, load_merge_rule
from orchestrator.config import SYNC_DILOCO_OUTER, ConfigError, RunConfig, apply_overrides, build_config
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.run.workload import _check_plugins
from policies.compression import compress, decompress
from policies.fragments import plan_fragments
from policies.merge_rules import merge_rule_names
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config
from tests.plugins.user_plugins import Half

RULE = "examples.extending.trimmed_mean:TrimmedMean"
WIRE = "tests.plugins.user_plugins:Half"
# Plain steps (lr 1, no momentum) so a round's new fragment is the old one minus the merged outer gradient.
PLUGINS = [f"outer.merge_rule={RULE}", f"outer.compression={WIRE}", "outer.lr=1.0", "outer.momentum=0.0",
           "outer.partial_momentum=0.0", "outer.min_quorum=3"]


def _config(*extra: str):
    return apply_overrides({}, [*PLUGINS, *extra])


def _trimmed(values: list[torch.Tensor]) -> torch.Tensor:
    """The hand computation for three islands: per coordinate the middle value (the ends dropped)."""
    return torch.stack(values).sort(dim=0).values[1]


def test_the_config_names_the_plugins_and_the_core_loads_them():
    cfg = build_config(_config())
    assert (cfg.outer.merge_rule, cfg.outer.compression) == (RULE, WIRE)
    assert isinstance(load_merge_rule(RULE), TrimmedMean) and isinstance(load_compressor(WIRE), Half)
    assert load_merge_rule(RULE) is load_merge_rule(f" {RULE} "), "loaded once, registered under its path"
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))  # what a run directory records, read back
    assert (again.outer.merge_rule, again.outer.compression) == (RULE, WIRE)


def test_a_run_directory_names_a_plugin_its_reader_need_not_import():
    recorded = {"outer": {"merge_rule": "gone.pkg:Rule", "compression": "gone.pkg:Wire"}}
    cfg = build_config(recorded, recorded=True)  # diloco report on a machine without the user's package
    assert (cfg.outer.merge_rule, cfg.outer.compression) == ("gone.pkg:Rule", "gone.pkg:Wire")
    with pytest.raises(ConfigError, match="cannot import module 'gone.pkg'"):
        build_config(recorded)  # a run that starts loads it
    with pytest.raises(ModelError, match="cannot import module 'gone.pkg' of merge rule 'gone.pkg:Rule'"):
        _check_plugins(cfg)  # and so does one that resumes, in prepare() before Ray (a ConfigError there)


def test_a_users_rule_and_compressor_train_through_the_engine_core():
    settings = outer_from_config(_config(), grace_gamma=0.0, grace_cap_s=0.0)
    w = nano_world(settings)
    inner = inner_from_config(lr=1e-2, warmup_steps=0, batch_size=2)
    islands = []
    for i in range(3):
        spec = spec_from_config(_config(), island=i, incarnation=1, pool="p", num_islands=3, model_config=w.cfg,
                                plan=w.plan, inner=inner, sync_every_steps=8, seed=1)
        assert spec.compression == WIRE
        islands.append(LearnerIsland(spec, w.data, w.latest))
        w.outer.register(i, 1)
    checked = 0
    for _ in range(8):  # P = 2, H = 8: each fragment is cut once by every island
        for island in islands:
            island.step()
        for island in islands:
            while (sub := island.next_submission(0)) is not None:
                assert all(c.scheme == WIRE and c.payload.dtype == torch.float16 for c in sub.payload)
                p = sub.fragment
                pending = [e.sub for e in w.outer._open[p].pending] + [sub]
                before = w.outer.fragment(p)
                results, refusal = w.outer.receive(sub, now=0.0)
                assert refusal is None, refusal
                for r in results:
                    assert sorted(r.record.participants) == [0, 1, 2]
                    for t, (old, new) in enumerate(zip(before, r.tensors)):
                        values = [decompress(s.payload[t]) for s in pending]
                        assert torch.equal(new, old - _trimmed(values)), (p, t)
                    mean = [old - sum(decompress(s.payload[t]) for s in pending) / 3 for t, old in enumerate(before)]
                    assert any(not torch.allclose(a, b) for a, b in zip(r.tensors, mean)), "the trimmed mean is no mean"
                    checked += 1
                    for island in islands:
                        island.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged,
                                                    refused=r.refused))
    assert checked == 2 and w.outer.versions == [1, 1]


def _core(*extra: str) -> OuterOptimizer:
    init = {"w": torch.zeros(4), "b": torch.zeros(2)}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 1)
    core = OuterOptimizer(init, plan, settings=outer_from_config(_config(*extra), grace_gamma=0.0, grace_cap_s=0.0))
    for island in range(3):
        core.register(island, 1)
    return core


def _round(core: OuterOptimizer, deltas: list[list[torch.Tensor]], scheme: str, base: int = 0) -> list[torch.Tensor]:
    for island, ds in enumerate(deltas):
        sub = Submission(island=island, incarnation=1, seq=base, fragment=0, base_version=base, tokens=100, inner_steps=10,
                         step_time_s=0.1, train_loss=3.0, payload=[compress(d, scheme) for d in ds])
        results, refusal = core.receive(sub, now=0.0)
        assert refusal is None, refusal
    assert len(results) == 1
    return results[0].tensors


def test_a_crafted_outlier_moves_the_mean_and_not_the_trimmed_mean():
    honest = [[torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, -0.5])],
              [torch.tensor([1.5, 2.5, 2.5, 4.5]), torch.tensor([0.25, -0.25])]]
    outlier = [torch.tensor([100.0, -100.0, 100.0, -100.0]), torch.tensor([50.0, 50.0])]
    deltas = [*honest, outlier]
    trimmed = _round(_core(), deltas, WIRE)
    # By hand: per coordinate the middle of the three values, so the outlier never counts.
    assert [t.tolist() for t in trimmed] == [[-1.5, -2.0, -3.0, -4.0], [-0.5, 0.25]]
    mean = _round(_core("outer.merge_rule=mean", "outer.compression=none"), deltas, "none")
    assert mean[0].tolist() == pytest.approx([-(1.0 + 1.5 + 100.0) / 3, -(2.0 + 2.5 - 100.0) / 3,
                                              -(3.0 + 2.5 + 100.0) / 3, -(4.0 + 4.5 - 100.0) / 3])


def test_a_checkpoint_of_a_plugin_run_resumes_with_the_same_next_round():
    first = [[torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, -0.5])]] * 2 + [[torch.ones(4), torch.ones(2)]]
    later = [[torch.tensor([0.5, 0.25, 2.0, -1.0]), torch.tensor([1.0, 2.0])],
             [torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([3.0, -2.0])], [torch.full((4,), 9.0), torch.ones(2)]]
    core = _core()
    _round(core, first, WIRE)
    tensors, meta = core.state_dict()
    resumed = _core()  # the config names the plug-ins again; the checkpoint holds tensors and numbers
    resumed.load_state_dict(tensors, meta)
    for a, b in zip(_round(core, later, WIRE, base=1), _round(resumed, later, WIRE, base=1)):
        assert torch.equal(a, b)


def test_a_submission_off_the_users_wire_is_refused():
    core = _core()
    sub = Submission(island=0, incarnation=1, seq=0, fragment=0, base_version=0, tokens=100, inner_steps=10,
                     step_time_s=0.1, train_loss=3.0, payload=[compress(torch.ones(4), "bf16"), compress(torch.ones(2), "bf16")])
    _, refusal = core.receive(sub, now=0.0)
    assert refusal is not None and f"wire format is not {WIRE!r}" in refusal.reason


@pytest.mark.parametrize("override, expected", [
    ("outer.merge_rule=tests.plugins.no_such_module:Rule", "cannot import module 'tests.plugins.no_such_module' of "
                                                            "merge rule"),
    ("outer.merge_rule=tests.plugins.user_plugins:TrimedMean", "did you mean 'TrimmedMean'?"),
    ("outer.merge_rule=tests.plugins.user_plugins:NotARule", "built a NotARule, not a policies.merge_rules.MergeRule; "
                                                             "subclass it and define merge_into(out, column, weights)"),
    ("outer.merge_rule=tests.plugins.user_plugins:Unfinished", "does not define merge_into"),
    ("outer.merge_rule=tests.plugins.user_plugins:NOT_CALLABLE", "is an object of type int, not a callable"),
    ("outer.merge_rule=trimmed", "unknown merge rule 'trimmed'; use one of rda, mean"),
    ("outer.compression=tests.plugins.user_plugins:TrimmedMean", "built a TrimmedMean, not a "
                                                                 "policies.compressor.Compressor; subclass it"),
    ("outer.compression=tests.plugins.user_plugins:NeedsArguments", "raised TypeError when built with no arguments"),
    ("outer.compression=fp8", "unknown compression 'fp8'; use one of none, bf16, int8, int4, int2, sign, topk"),
])
def test_what_does_not_load_is_one_config_line(override, expected):
    with pytest.raises(ConfigError) as err:
        build_config(apply_overrides({}, [override]))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_built_ins_are_registered_and_the_presets_name_them():
    assert merge_rule_names()[:2] == ("rda", "mean")
    assert SYNC_DILOCO_OUTER["merge_rule"] in merge_rule_names()
