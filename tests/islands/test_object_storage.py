"""A corpus in object storage: indexed from metadata, read unit by unit, and compared copy with copy, over S3.

moto's S3 server runs in this process (one per module, on a free port) and pyarrow.fs reaches it through URIs
that carry everything it needs (``s3://KEY:SECRET@bucket/prefix?endpoint_override=...&scheme=http&region=...``),
so nothing here depends on the environment's AWS settings. Everything goes through the public functions the
driver and the islands call (orchestrator/run/streams.py, islands/corpus.py, islands/stream.py); the same files
also lie on local disk, and what S3 gives must be what the disk gives. No Ray: `diloco train` is refused before
Ray (and torch) could even be imported.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from islands.corpus import UnitError, heldout_sample, read_unit
from islands.data import DataError
from islands.stream import StreamSampler
from orchestrator.config import build_config
from orchestrator.run.streams import check_copies, corpus_index, corpus_stream

ROOT = Path(__file__).resolve().parents[2]
KEY, SECRET = "testing", "not-a-secret"
VOCAB = 256
UNIT = 500  # tokens per unit of the token files: 16 units, so a few batches cross units

# `diloco train` with Ray and torch unimportable (as tests/engine/test_preflight.py runs it): a refusal with exit
# code 2 instead of an ImportError traceback was decided before Ray could start.
BLOCKED_CLI = """
import runpy, sys
for name in ("ray", "torch"):
    sys.modules[name] = None
sys.argv[0] = "diloco"
runpy.run_module("orchestrator.cli", run_name="__main__")
"""


class S3:
    """The module's S3 server: its endpoint, URIs into it, and the same corpora on local disk."""

    def __init__(self, host: str, port: int, local: Path, client) -> None:
        self.endpoint = f"{host}:{port}"
        self.local = local  # local/text: the Parquet files; local/tokens: the token files
        self.client = client  # boto3's, to change the buckets

    def uri(self, bucket: str, prefix: str, *, key: str = KEY, secret: str = SECRET, endpoint: str | None = None) -> str:
        return (f"s3://{key}:{secret}@{bucket}/{prefix}?endpoint_override={endpoint or self.endpoint}"
                f"&scheme=http&region=us-east-1")

    def set_auth(self, enforce: bool) -> None:
        """moto accepts any key unless told to check them (its reset-auth endpoint: 0 requests go unchecked)."""
        request = urllib.request.Request(f"http://{self.endpoint}/moto-api/reset-auth", data=b"0" if enforce else b"inf",
                                         method="POST", headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()


def text_table(part: int) -> pa.Table:
    rng = np.random.default_rng(part)
    words = ["def", "return", "class", "import", "lambda", "yield", "for", "in", "while", "pass"]
    return pa.table({"text": [f"doc {part}.{i}: " + " ".join(rng.choice(words, size=int(rng.integers(3, 12))))
                              for i in range(120)],
                     "n": list(range(120))})


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server with buckets `corpus` (text/: two Parquet files of 3 row groups, tokens/: two uint16 token
    files, empty/: no token file, doomed/: token files a test deletes), `copy` (tokens/ as in corpus) and `differ`
    (tokens/ with b.bin shorter); the Parquet and token files also on local disk."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    local = tmp_path_factory.mktemp("corpora")
    (local / "text").mkdir()
    (local / "tokens").mkdir()
    for part in range(2):
        pq.write_table(text_table(part), local / "text" / f"part-{part}.parquet", row_group_size=40)
    rng = np.random.default_rng(0)
    tokens = {"a.bin": rng.integers(0, VOCAB, 5000, dtype=np.uint16), "b.bin": rng.integers(0, VOCAB, 3000, dtype=np.uint16)}
    for name, ids in tokens.items():
        ids.astype("<u2").tofile(local / "tokens" / name)
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                          region_name="us-east-1")
    for bucket in ("corpus", "copy", "differ"):
        client.create_bucket(Bucket=bucket)
    for part in range(2):
        name = f"part-{part}.parquet"
        client.put_object(Bucket="corpus", Key=f"text/{name}", Body=(local / "text" / name).read_bytes())
    for name in tokens:
        body = (local / "tokens" / name).read_bytes()
        for bucket, prefix in (("corpus", "tokens"), ("corpus", "doomed"), ("copy", "tokens"), ("differ", "tokens")):
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body[:5000] if bucket == "differ" and name == "b.bin" else body)
    client.put_object(Bucket="corpus", Key="empty/README.txt", Body=b"token files go here\n")
    store = S3(host, port, local, client)
    yield store
    store.set_auth(False)
    server.stop()


def config(path: str, *, source: str = "tokens", copies: dict[str, str] | None = None, **data) -> object:
    """Two pools (a, b) of one island each; `copies`: pool -> its data_path."""
    copies = copies or {}
    fields = {"source": source, "path": path, **({"vocab_size": VOCAB, "unit_tokens": UNIT} if source == "tokens" else {}), **data}
    return build_config({
        "model": {"preset": "nano"},
        "data": fields,
        "pools": [{"name": p, "islands": 1, **({"data_path": copies[p]} if p in copies else {})} for p in ("a", "b")],
    })


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ index and read


def test_parquet_on_s3_is_indexed_from_its_footers_and_reads_as_the_local_copy(s3):
    index = corpus_index(config(s3.uri("corpus", "text"), source="parquet", text_column="text"))
    local = corpus_index(config(str(s3.local / "text"), source="parquet", text_column="text"))
    # A unit per row group, named by file and group, sized from the footers: the same as the local copy's.
    assert [u.name for u in index.units] == [f"part-{p}.parquet#{g}" for p in range(2) for g in range(3)]
    assert index.keys() == local.keys() and all(u.count == 40 and u.tokens > 0 for u in index.units)
    assert index.root == s3.uri("corpus", "text")
    for unit in index.units:
        for heldout in (False, True):
            ids = read_unit(index.fmt, index.root, unit, heldout=heldout)
            assert np.array_equal(ids, read_unit(local.fmt, local.root, unit, heldout=heldout)), (unit.name, heldout)
    assert sum(len(read_unit(index.fmt, index.root, u)) for u in index.units) > 6 * 40 * 10  # text was read, not nothing
    sample = heldout_sample(index, max_tokens=10_000)
    assert len(sample) > 0 and np.array_equal(sample, heldout_sample(local, max_tokens=10_000))


def test_token_files_on_s3_stream_the_same_batches_as_a_local_copy(s3):
    cfg = config(s3.uri("corpus", "tokens"), copies={"b": s3.uri("copy", "tokens")}, block_batches=4)
    plan = corpus_stream(cfg)
    # Units cut from the files' sizes alone: 5000 + 3000 tokens in units of 500.
    assert [u.name for u in plan.index.units] == [f"a.bin@{s}" for s in range(0, 5000, UNIT)] + [f"b.bin@{s}" for s in range(0, 3000, UNIT)]
    assert plan.stream.root == s3.uri("corpus", "tokens") and plan.stream.roots == {"b": s3.uri("copy", "tokens")}
    local_index = corpus_index(config(str(s3.local / "tokens")))
    assert np.array_equal(plan.heldout, heldout_sample(local_index, max_tokens=cfg.data.heldout_tokens)) and len(plan.heldout)
    local_stream = replace(plan.stream, root=str(s3.local / "tokens"), roots={})
    for island, pool in ((0, "a"), (1, "b")):
        samplers = [StreamSampler(stream, island=island, seq_len=16, batch_size=4, seed=0, pool=pool)
                    for stream in (plan.stream, local_stream)]
        assert samplers[0].root == plan.stream.root_for(pool) and samplers[1].root == str(s3.local / "tokens")
        try:
            for _ in range(24):  # 24 batches of 4 x 16 tokens: six blocks, across several 500-token units
                (x, y), (lx, ly) = (s.next_batch() for s in samplers)
                assert torch.equal(x, lx) and torch.equal(y, ly)
            assert samplers[0].bytes_read > 0 and not samplers[0].skipped
        finally:
            for s in samplers:
                s.close()


def test_a_unit_deleted_after_indexing_is_a_unit_error_naming_it(s3):
    index = corpus_index(config(s3.uri("corpus", "doomed")))
    s3.client.delete_object(Bucket="corpus", Key="doomed/b.bin")
    unit = next(u for u in index.units if u.path == "b.bin")
    with pytest.raises(UnitError, match=r"unit 'b\.bin@0' of .* could not be read") as err:
        read_unit(index.fmt, index.root, unit)
    one_line(err)
    assert len(read_unit(index.fmt, index.root, index.units[0])) == UNIT  # the rest of the corpus still reads


# ------------------------------------------------------------------ copies


def test_an_identical_copy_is_accepted_and_a_differing_one_refused_naming_the_pool(s3):
    path = s3.uri("corpus", "tokens")
    assert check_copies(config(path, copies={"b": s3.uri("copy", "tokens")}), corpus_index(config(path))) == \
        {"b": s3.uri("copy", "tokens")}
    cfg = config(path, copies={"a": s3.uri("copy", "tokens"), "b": s3.uri("differ", "tokens")})
    with pytest.raises(DataError, match=r"pools\.b\.data_path=.* is not a copy of data\.path=.*: 'b\.bin' holds 2,500 against 3,000") as err:
        check_copies(cfg, corpus_index(cfg))
    one_line(err)


# ------------------------------------------------------------------ storage that cannot be read


def test_wrong_credentials_say_to_check_the_credentials(s3):
    cfg = config(s3.uri("corpus", "tokens", key="AKIAWRONG", secret="wrong-secret"))
    s3.set_auth(True)
    try:
        with pytest.raises(DataError, match=r"access to .* was refused .*; check the credentials") as err:
            corpus_index(cfg)
    finally:
        s3.set_auth(False)
    assert "wrong-secret" not in one_line(err)


# ------------------------------------------------------------------ `diloco train`, before Ray starts


def diloco_train(tmp: Path, *sets: str) -> subprocess.Popen:
    """`diloco train --quiet --run-dir TMP/run --set ...` (nano, token files of vocabulary 256) started with Ray and
    torch unimportable."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    args = ["--set", "model.preset=nano", "--set", "data.source=tokens", "--set", f"data.vocab_size={VOCAB}",
            "--set", f"data.unit_tokens={UNIT}"]
    for item in sets:
        args += ["--set", item]
    return subprocess.Popen([sys.executable, "-c", BLOCKED_CLI, "train", "--quiet", "--run-dir", str(tmp / "run"), *args],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_bad_storage_and_copies_are_one_line_errors_in_process_and_from_diloco_train_before_ray(s3, tmp_path):
    """`diloco train` refuses, exit code 2 and one line, copies that differ, an endpoint nobody listens on and a
    prefix without token files; the same unreachable endpoint is a one-line DataError in this process too.

    Side by side, because pyarrow retries a refused connection for about 6 s before it gives up: the three CLI
    runs (each a Python start-up) and the in-process check wait it out together."""
    unreachable = s3.uri("corpus", "tokens", endpoint=f"127.0.0.1:{closed_port()}")
    cases = {
        "differ": ([f"data.path={s3.uri('corpus', 'tokens')}", f"pools.slow.data_path={s3.uri('differ', 'tokens')}"],
                   r"^diloco train: pools\.slow\.data_path=.* is not a copy of data\.path=.*: 'b\.bin' holds 2,500 against 3,000"),
        "unreachable": ([f"data.path={unreachable}"], r"^diloco train: cannot reach .*; check the endpoint"),
        "no files": ([f"data.path={s3.uri('corpus', 'empty')}"],
                     r"^diloco train: directory .* has no \.bin/\.tokens/\.u16/\.u32 token files; point at the directory"),
    }
    running = {}
    for name, (sets, _) in cases.items():
        (tmp_path / name).mkdir()
        running[name] = diloco_train(tmp_path / name, *sets)
    try:
        with pytest.raises(DataError, match=r"cannot reach .*; check the endpoint \(the URI's endpoint_override") as err:
            corpus_index(config(unreachable))
        assert SECRET not in one_line(err), "the URI's secret stays out of messages"
        done = {name: (p.communicate(timeout=120), p.returncode) for name, p in running.items()}
    finally:
        for p in running.values():
            if p.poll() is None:
                p.kill()
    for name, (_, pattern) in cases.items():
        (_, stderr), code = done[name]
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1, (name, code, stderr[-2000:])
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert not (tmp_path / name / "run").exists(), "refused before the run directory was made"
