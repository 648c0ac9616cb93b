"""`DilocoTrainer.fit()` shows its start-up and progress by default, one unit per loss (no Ray).

The driver's `train` is replaced by a stand-in that reports what a run reports (a start-up stage, then
progress ticks), so what `fit()` prints is checked without starting Ray; tests/api/test_readme_example.py
sees the same lines from a real run.
"""

from __future__ import annotations

import io
import math

import pytest

from orchestrator import DilocoTrainer, Progress, ProgressPrinter
from orchestrator.run.startup import Stage


def tick(tokens: int, elapsed_s: float, *, budget: int = 3_000_000, train_loss=None, eval_bpb=None,
         unit: str = "byte") -> Progress:
    return Progress(tokens=tokens, budget=budget, versions=[3, 2], rounds=5, train_loss=train_loss, eval_bpb=eval_bpb,
                    elapsed_s=elapsed_s, islands={"fast/0": "training", "fast/1": "training", "slow/2": "starting"},
                    unit=unit)


@pytest.fixture
def fake_train(monkeypatch):
    """orchestrator.run.driver.train as a run calls back: one start-up stage, three ticks 4 s apart, the last at the
    budget; records the callables it was given."""
    given = {}

    def train(cfg, run_dir, *, address=None, progress=None, resume=False, stages=None, workload=None, prepared=None,
              callbacks=None):
        given.update(progress=progress, stages=stages)
        if stages is not None:
            stages(Stage("ray", "starting a local Ray"))
        if progress is not None:
            for i, tokens in enumerate((0, 1_000_000, 3_000_000)):
                progress(tick(tokens, 4.0 * i, train_loss=1.5 if i else None, eval_bpb=2.0 if i else None))
        return {"eval_loss": 1.0}

    monkeypatch.setattr("orchestrator.run.driver.train", train)
    return given


def test_fit_prints_the_start_up_and_progress_by_default_and_progress_false_silences_it(fake_train, tmp_path,
                                                                                      capsys):
    """The bug: fit() printed nothing for the whole run unless given progress=."""
    result = DilocoTrainer(run_dir=tmp_path / "run").fit()
    assert result.metrics == {"eval_loss": 1.0}
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("EMULATION: pool speeds emulated"), "the default pools' slow one is emulated"
    assert lines[1].startswith("start-up ") and lines[1].endswith("s  starting a local Ray")
    # Three ticks within 10 s: the first, and the one at the budget.
    assert [line.split()[1] for line in lines[2:]] == ["0%", "100%"], lines
    assert isinstance(fake_train["progress"], ProgressPrinter)

    DilocoTrainer(run_dir=tmp_path / "quiet", progress=False).fit()
    assert capsys.readouterr() == ("", "") and fake_train["progress"] is None and fake_train["stages"] is None

    seen = []
    DilocoTrainer(run_dir=tmp_path / "mine", progress=seen.append).fit()
    assert len(seen) == 3 and capsys.readouterr().err == "" and fake_train["stages"] is None


def test_a_progress_line_gives_each_loss_its_unit_and_comes_every_few_seconds():
    now = [100.0]
    out = io.StringIO()
    printer = ProgressPrinter(out, every_s=10.0, clock=lambda: now[0])
    printer(tick(0, 0.0))
    for t in (3.0, 9.0):  # within 10 s of the first line: nothing
        now[0] = 100.0 + t
        printer(tick(400_000, t, train_loss=1.7))
    now[0] = 112.0
    printer(tick(1_110_000, 12.0, train_loss=2.095 * math.log(2), eval_bpb=2.16))
    now[0] = 113.0
    printer(tick(3_000_000, 13.0, train_loss=1.2 * math.log(2), eval_bpb=1.3, unit="token"))  # the budget: at once
    first, second, last = out.getvalue().splitlines()
    assert first == ("progress   0%  0.00M/3.00M tokens | versions [3, 2] | rounds 5 | bits/byte: train -, held-out - | "
                     "0s | islands 1 starting, 2 training")
    # Both losses in bits per byte: the islands' nats are converted, not shown beside bits.
    assert "| bits/byte: train 2.095, held-out 2.160 | 12s |" in second
    assert second.startswith("progress  37%  1.11M/3.00M tokens") and "nats" not in second
    assert "| bits/token: train 1.200, held-out 1.300 |" in last
    with pytest.raises(ValueError, match="every_s=-1 is negative"):
        ProgressPrinter(every_s=-1)
