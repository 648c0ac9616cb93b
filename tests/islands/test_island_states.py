"""The island states (policies/island_states.py), without Ray: an island's straggler and divergence checks set
them; states compare equal to, print as and serialize as their strings, and no module compares or sets a state
by a bare string any more.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from islands.island import IslandFailed, LearnerIsland
from islands.trainer import StepResult
from policies.goodput import TIMELINE_STATES
from policies.island_states import ENDED_BADLY, REPORTED, IslandState
from tests.islands.test_fsdp import initial, make_data, spec, updates

ROOT = Path(__file__).resolve().parents[2]


def _stepping(result: StepResult) -> LearnerIsland:
    island = LearnerIsland(spec(workers=1, shard="none"), make_data(), updates(0, initial()))
    island.trainer.step = lambda: result  # type: ignore[method-assign]
    return island


def test_an_injected_slowdown_stretches_the_step_it_follows():
    island = _stepping(StepResult(loss=1.0, tokens=8, compute_s=0.01, wall_s=0.01))
    island.inject("slow", factor=3.0)
    assert island.step() is True
    assert island.status().step_time_s == pytest.approx(0.03)


def test_a_non_finite_loss_fails_the_island_as_diverged():
    island = _stepping(StepResult(loss=math.nan, tokens=8, compute_s=0.01, wall_s=0.01))
    with pytest.raises(IslandFailed, match="diverged: non-finite training loss at step 0"):
        island.step()
    island.run()  # records the failure instead of raising
    status = island.status()
    assert status.state is IslandState.DIVERGED and status.steps == 0
    with pytest.raises(IslandFailed):
        island.next_submission(timeout_s=0)


def test_states_are_their_strings_in_comparisons_text_and_json():
    state = IslandState.BLOCKED
    assert state == "blocked" and "blocked" in {state} and {state: 1}["blocked"] == 1
    assert str(state) == f"{state}" == "%s" % state == "blocked"  # noqa: UP031 - logging formats with %
    assert json.dumps({"state": state, state: [IslandState.DEAD]}) == '{"state": "blocked", "blocked": ["dead"]}'
    assert set(ENDED_BADLY) <= set(REPORTED)
    assert set(REPORTED) | set(TIMELINE_STATES) == set(IslandState), "a state nobody reports or records"


def _bare_state_literals(path: Path, root: Path = ROOT) -> list[str]:
    """`x.state == "blocked"`, `state in ("dead", ...)`, `self.state = "training"`, `state="starting"`,
    `record.mark(slot, "dead")`: their lines."""
    values = {s.value for s in IslandState}

    def is_state(node: ast.AST) -> bool:
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        return "state" in name.lower()

    def bare(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(bare(e) for e in node.elts)
        if isinstance(node, ast.IfExp):
            return bare(node.body) or bare(node.orelse)
        return isinstance(node, ast.Constant) and node.value in values

    found: list[int] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_state(o) for o in operands) and any(bare(o) for o in operands):
                found.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_state(t) for t in targets) and bare(node.value):
                found.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg and "state" in node.arg and bare(node.value):
            found.append(node.value.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "mark" \
                and any(bare(a) for a in node.args):  # RecoveryRecord.mark(slot, state): the timeline's states
            found.append(node.lineno)
    return [f"{path.relative_to(root)}:{line}" for line in sorted(found)]


def test_no_module_compares_or_sets_a_state_by_a_bare_string():
    found = [hit for package in ("orchestrator", "islands", "policies") for path in sorted((ROOT / package).rglob("*.py"))
             if path.name != "island_states.py" for hit in _bare_state_literals(path)]
    assert not found, f"use policies.island_states.IslandState at {found}"


def test_the_bare_string_check_finds_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f(slot, record):\n    slot.state = "training"\n    mark(slot, state="dead")\n'
                     '    record.mark(slot, "blocked")\n    return slot.state in ("dead", "vacant")\n')
    assert _bare_state_literals(probe, tmp_path) == ["probe.py:2", "probe.py:3", "probe.py:4", "probe.py:5"]
