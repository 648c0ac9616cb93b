"""`diloco report RUN_DIR --baseline OTHER_RUN_DIR`: how far a run is from a baseline run (usually `diloco
baseline-dp` on the same model and data), from the two run directories' files alone.

The numbers are policies.quality_gap's: held-out loss at equal tokens, bytes per token, the run's time to the
baseline's final loss. The comparison is only as fair as the two runs are alike, so the fields that decide what a
held-out loss means (the model, the data, the held-out evaluation) are compared and every difference is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from policies.quality_gap import EvalPoint, QualityGap, quality_gap

__all__ = ["BaselineComparison", "ReportError", "compare_to_baseline"]

# Config fields whose difference changes what a held-out loss means (data plumbing such as read-ahead does not).
_SAME_MEANING = ("model", "data.source", "data.path", "data.text_column", "data.token_column", "data.tokenizer",
                 "data.vocab_size", "data.heldout_fraction", "data.max_bytes", "data.shuffle_documents",
                 "data.heldout_tokens", "eval.batches", "eval.batch_size")


class ReportError(ValueError):
    """A run directory the report cannot be built from; the message names the path and the fix (here, not in
    orchestrator.run.report, which imports this module: one direction, no import circle)."""


class BaselineComparison:
    """A run against a baseline run: the gap (`policies.quality_gap.QualityGap`), the two runs' modes and names,
    their emulation notes, and the config fields in which they differ (`differences`, "field: run vs baseline")."""

    def __init__(self, gap: QualityGap, run_mode: str, baseline_mode: str, baseline_dir: Path,
                 differences: list[str], emulation: list[str]) -> None:
        self.gap, self.run_mode, self.baseline_mode = gap, run_mode, baseline_mode
        self.baseline_dir, self.differences, self.emulation = baseline_dir, differences, emulation

    def line(self) -> str:
        """One line for the console: the loss gap at equal tokens and the bytes per token."""
        g = self.gap
        out = (f"against {self.baseline_mode} run {self.baseline_dir.resolve().name} at {g.tokens:,.0f} tokens: "
               f"held-out loss {g.loss:.4f} vs {g.baseline_loss:.4f} ({g.relative:+.1%})")
        if g.bytes_ratio is not None:
            out += f", {g.bytes_ratio:.1f}x fewer bytes per token" if g.bytes_ratio >= 1 else \
                f", {1 / g.bytes_ratio:.1f}x more bytes per token"
        if self.differences:
            out += f"; the runs differ in {', '.join(d.split(':')[0] for d in self.differences)}"
        return out

    def markdown(self) -> str:
        """report.md's section "Against the baseline"."""
        g = self.gap
        reached = (f"{g.time_to_baseline_loss_s:.0f} s (the baseline's: {g.baseline_time_s:.0f} s)"
                   if g.time_to_baseline_loss_s is not None else f"not reached (the baseline's: {g.baseline_time_s:.0f} s)")
        rows = [("baseline", f"`{self.baseline_dir}` ({self.baseline_mode})"),
                ("compared at (tokens processed, the smaller final count)", f"{g.tokens:,.0f}"),
                ("held-out loss, this run / the baseline (nats per token)", f"{g.loss:.4f} / {g.baseline_loss:.4f}"),
                ("gap", f"{g.relative:+.2%}"),
                ("bytes per token, the baseline's over this run's",
                 f"{g.bytes_ratio:.1f}x" if g.bytes_ratio is not None else "n/a (a run sent no bytes)"),
                ("seconds of training to the baseline's final loss", reached)]
        out = ["## Against the baseline", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
        out += [f"- {e}" for e in self.emulation]
        if self.differences:
            out += ["The runs differ where it changes what a held-out loss means, so the gap is not like for like:", ""]
            out += [f"- {d}" for d in self.differences]
        return "\n".join(out).rstrip() + "\n"


def _load(run_dir: Path, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ReportError(f"{what} {run_dir} has no summary.json; pass the directory of a finished run")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"{path} is not valid JSON ({err}); the run may have died while writing it") from None
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    return summary, config or {}


def _points(summary: dict[str, Any], what: str, run_dir: Path) -> list[EvalPoint]:
    points = [EvalPoint(float(e["tokens_processed"]), float(e["eval_loss"]), float(e.get("wall_s") or 0.0))
              for e in summary.get("evals") or [] if e.get("eval_loss") is not None]
    if not points:
        raise ReportError(f"{what} {run_dir} has no held-out evaluations in its summary.json; nothing to compare")
    return points


def _field(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _differences(run: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    out = []
    for field in _SAME_MEANING:
        a, b = _field(run, field), _field(baseline, field)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{field}.{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{field}: {a!r} vs {b!r}")
    return out


def compare_to_baseline(run_dir: str | Path, baseline_dir: str | Path) -> BaselineComparison:
    """Compare the finished run in `run_dir` with the one in `baseline_dir`.

    Raises:
        ReportError: either directory lacks a readable summary.json or held-out evaluations.
    """
    run_dir, baseline_dir = Path(run_dir), Path(baseline_dir)
    summary, config = _load(run_dir, "the run")
    base_summary, base_config = _load(baseline_dir, "the baseline")
    gap = quality_gap(_points(summary, "the run", run_dir), _points(base_summary, "the baseline", baseline_dir),
                      run_bytes=summary.get("bytes_sent"), baseline_bytes=base_summary.get("bytes_sent"))
    notes = (summary.get("emulation"), base_summary.get("emulation"), summary.get("network"), base_summary.get("network"))
    emulation = [str(e) for e in notes if e and "EMULAT" in str(e)]  # emulated speeds and links, labelled as such
    return BaselineComparison(gap, str(summary.get("mode", "run")), str(base_summary.get("mode", "run")), baseline_dir,
                              _differences(config, base_config), list(dict.fromkeys(emulation)))
