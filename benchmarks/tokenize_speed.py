"""Tokenizing speed: seconds for ``islands.data.tokenize_corpus`` to encode 1 MB of standard-library text.

Run from the repository root (needs the ``hf`` extra; the load average is printed with the results)::

    python benchmarks/tokenize_speed.py              # 1 MB, 5 repeats
    python benchmarks/tokenize_speed.py --quick      # 1 repeat: a smoke run, not a measurement

A BPE of vocabulary 1000 is fitted on 200 KB of the corpus (``islands.tokenizer.train_tokenizer``, as
tests/islands/test_tokenizer.py does), then each repeat times, alternating which goes first:

- subject: ``tokenize_corpus`` over a ``TokenizersEncoder`` (what a run with ``data.tokenizer`` does to
  its text: encode each split, join documents with the end token, check the ids, narrow the dtype);
- baseline: the ``tokenizers`` library's own ``Tokenizer.encode_batch`` over the same documents, ids
  left as Python lists (the Rust encoder alone, nothing of ours).

The ratio subject / baseline is what our wrapper costs. Target: 1 MB in under 10 s on 2 cores (the bound a
test asserted before timings moved here). Nothing is asserted; medians over repeats are printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from islands.data import stdlib_texts, tokenize_corpus  # noqa: E402
from islands.tokenizer import TokenizersEncoder, train_tokenizer  # noqa: E402

TARGET_S = 10.0


def _subject(encoder: TokenizersEncoder, train: list[str], heldout: list[str], source: str) -> float:
    start = time.perf_counter()
    tokenize_corpus(train, heldout, encoder, source)
    return time.perf_counter() - start


def _baseline(encoder: TokenizersEncoder, train: list[str], heldout: list[str]) -> float:
    start = time.perf_counter()
    for docs in (train, heldout):
        encoder.tokenizer.encode_batch(list(docs), add_special_tokens=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1.0, help="megabytes of stdlib text to tokenize (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="1 repeat: a smoke run, not a measurement")
    ap.add_argument("--json", metavar="OUT", help="also write every repeat and the medians as JSON")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)

    fit_train, _, _ = stdlib_texts(max_bytes=200_000)
    encoder = TokenizersEncoder(train_tokenizer(fit_train, vocab_size=1000))
    train, heldout, source = stdlib_texts(max_bytes=int(args.mb * 1_000_000))
    nbytes = sum(len(d.encode()) for d in train + heldout)
    _subject(encoder, train, heldout, source)  # warm: first-call costs are neither side's
    runs = []
    for r in range(repeats):
        order = ("subject", "baseline") if r % 2 == 0 else ("baseline", "subject")
        got = {side: (_subject(encoder, train, heldout, source) if side == "subject" else _baseline(encoder, train, heldout))
               for side in order}
        runs.append(got)
        print(f"repeat {r + 1}/{repeats}: tokenize_corpus {got['subject']:.2f} s, encode_batch {got['baseline']:.2f} s",
              flush=True)
    subject = statistics.median(r["subject"] for r in runs)
    baseline = statistics.median(r["baseline"] for r in runs)
    ratio = statistics.median(r["subject"] / r["baseline"] for r in runs)
    per_mb = subject / (nbytes / 1e6)
    load = os.getloadavg()
    print(f"\n{datetime.date.today()}: {nbytes / 1e6:.2f} MB of stdlib text, BPE vocab 1000, {repeats} repeats, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + (" (--quick: not a measurement)" if args.quick else ""))
    print("\n| side | median s | s per MB | ratio to baseline |\n| --- | ---: | ---: | ---: |")
    print(f"| tokenize_corpus (ours) | {subject:.2f} | {per_mb:.2f} | {ratio:.3f} |")
    print(f"| tokenizers encode_batch (baseline) | {baseline:.2f} | {baseline / (nbytes / 1e6):.2f} | 1.000 |")
    verdict = "met" if per_mb < TARGET_S else "missed"
    print(f"\ntarget: 1 MB in under {TARGET_S:.0f} s: {per_mb:.2f} s per MB, {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "bytes": nbytes, "median_s": subject, "baseline_s": baseline, "ratio": ratio,
                       "s_per_mb": per_mb, "load": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
