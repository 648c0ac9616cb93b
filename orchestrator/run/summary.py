"""The tables printed after a run: the engine's final summary, and the held-out loss cell every summary
table shares (`diloco train` and `diloco baseline-dp`). Plain dicts in, text out; no Ray."""

from __future__ import annotations


def held_out_loss_cell(summary: dict) -> str:
    """The final held-out loss as the summary tables print it: under run.average_window it is the served
    moving average's, and the raw global model's follows it."""
    raw = summary.get("eval_loss_raw")
    return f"{summary['eval_loss']:.4f}" + ("" if raw is None else f" (moving average; raw global model {raw:.4f})")


def format_summary(summary: dict) -> str:
    """The short final table printed after `diloco train`."""
    rows = [
        ("mode", summary["mode"]),
        ("held-out loss (nats/byte)", held_out_loss_cell(summary)),
        ("held-out bits/byte", f"{summary['eval_bits_per_byte']:.3f}"),
        ("unigram bits/byte (baseline)", f"{summary['unigram_bits_per_byte']:.3f}"),
        ("tokens processed", f"{summary['tokens_processed']:,}"),
        ("tokens merged / refused / in flight", f"{summary['tokens_merged']:,.0f} / {summary['tokens_refused']:,.0f} / {summary['tokens_in_flight']:,.0f}"),
        ("rounds (refusals)", f"{summary['rounds']} ({summary['refusals']})"),
        ("bytes sent (up + down)", f"{summary['bytes_sent'] / 1e6:,.1f} MB"),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for isl in summary["islands"]:
        # Where and in what arithmetic, when not the plain CPU fp32 of most runs (GPU pools, per-pool precision).
        device, precision = isl.get("device"), isl.get("precision")
        where = f", {device or 'cpu'} {precision or 'fp32'}" if device not in (None, "cpu") or precision not in (None, "fp32") else ""
        lines.append(f"{'  island ' + str(isl['island']) + ' (' + isl['pool'] + ')':<{width}}  "
                     f"{isl['steps']} steps, {isl['tokens']:,} tokens, {isl['state']}{where}")
    if summary.get("emulation"):
        lines.append(summary["emulation"])
    if summary.get("network_emulated"):
        lines.append(summary["network"])  # starts with "EMULATED network"
    return "\n".join(lines)
