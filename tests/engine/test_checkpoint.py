"""CheckpointStore: bitwise round trips, retention, commit protocol, damage detection, no code on load."""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import pickle

import pytest
import torch

from orchestrator.core.checkpoint import MANIFEST_FILE, PAYLOAD_FILE, TMP_SUFFIX, Checkpoint, CheckpointError, CheckpointStore, checkpoint_dirname

LOGGER = "orchestrator.core.checkpoint"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).half(),
        "f32_special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        "f64": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "transposed": base.t(),  # non-contiguous
        "strided_view": base[::2, 1::3],  # non-contiguous view of a larger storage
    }


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.is_contiguous(), name
        # Compare bytes, not values: NaN != NaN and -0.0 == 0.0 would hide differences.
        assert g.reshape(-1).view(torch.uint8).tolist() == w.contiguous().reshape(-1).view(torch.uint8).tolist(), name


def _dir(tmp_path: pathlib.Path, step: int) -> pathlib.Path:
    return tmp_path / checkpoint_dirname(step)


def test_round_trip_is_bitwise_and_keeps_meta(tmp_path):
    store = CheckpointStore(str(tmp_path))
    tensors = _tensors()
    meta = {"round": 7, "islands": ["a", "b"], "lr": 0.7, "nested": {"ok": True, "none": None}}
    path = store.save(1, tensors, meta)
    ck = store.load(1)
    assert isinstance(ck, Checkpoint) and ck.step == 1 and ck.path == path and ck.meta == meta
    _assert_bitwise(ck.tensors, tensors)
    latest = store.load_latest()
    assert latest is not None and latest.step == 1
    _assert_bitwise(latest.tensors, tensors)


def test_loaded_tensors_are_independent_and_writable(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"a": torch.zeros(3), "b": torch.ones(3)}, {})
    ck = store.load(1)
    ck.tensors["a"] += 5
    assert ck.tensors["b"].tolist() == [1.0, 1.0, 1.0]
    assert store.load(1).tensors["a"].tolist() == [0.0, 0.0, 0.0]


def test_keep_retains_only_the_newest(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (1, 3, 4, 9):
        store.save(step, {"w": torch.full((2,), float(step))}, {"step": step})
    assert store.list() == [4, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_dirname(4), checkpoint_dirname(9)]
    assert store.load(4).tensors["w"].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_positive_int(tmp_path, keep):
    with pytest.raises(ValueError, match="keep="):
        CheckpointStore(str(tmp_path), keep=keep)


def test_step_must_increase(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(5, {"w": torch.zeros(1)}, {})
    for step in (5, 4):
        with pytest.raises(CheckpointError, match=f"step={step} must be larger than .* 5"):
            store.save(step, {"w": torch.zeros(1)}, {})
    assert store.list() == [5]


def test_bad_inputs_are_refused_in_one_line(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step, tensors, meta in [(1, {"w": torch.zeros(1)}, {"x": object()}),
                                (1, {"w": [1.0]}, {}),
                                (-1, {"w": torch.zeros(1)}, {})]:
        with pytest.raises(CheckpointError) as info:
            store.save(step, tensors, meta)
        assert "\n" not in str(info.value)
    assert store.list() == []


def test_load_missing_step_raises(tmp_path):
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(CheckpointError, match="step 3 not found"):
        store.load(3)
    assert store.load_latest() is None


def _flip_bytes(p: pathlib.Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _truncate(p: pathlib.Path) -> None:
    p.write_bytes(p.read_bytes()[:-3])


def _garble_manifest(p: pathlib.Path) -> None:
    (p.parent / MANIFEST_FILE).write_text('{"format": 1, "ste')


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate, pathlib.Path.unlink, _garble_manifest],
                         ids=["flipped", "truncated", "payload_deleted", "manifest_garbled"])
def test_damaged_latest_is_skipped_with_a_warning(tmp_path, caplog, damage):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"w": torch.arange(64, dtype=torch.float32)}, {"good": True})
    store.save(2, {"w": torch.arange(64, dtype=torch.float32) * 2}, {"good": False})
    damage(_dir(tmp_path, 2) / PAYLOAD_FILE)
    assert store.list() == [1, 2]  # the manifest is there; damage shows only on load
    with pytest.raises(CheckpointError):
        store.load(2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck = store.load_latest()
    assert ck is not None and ck.step == 1 and ck.meta == {"good": True}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and checkpoint_dirname(2) in warnings[0].getMessage()


def test_all_damaged_gives_none(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"w": torch.ones(4)}, {})
    _flip_bytes(_dir(tmp_path, 1) / PAYLOAD_FILE)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.load_latest() is None
    assert checkpoint_dirname(1) in caplog.text


def test_interrupted_save_is_invisible_and_cleaned_up(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"w": torch.ones(2)}, {"n": 1})
    # Crash mid-save of step 2: temp payload and temp manifest written, neither moved into place.
    d2 = _dir(tmp_path, 2)
    d2.mkdir()
    (d2 / (PAYLOAD_FILE + TMP_SUFFIX)).write_bytes(b"\x00" * 8)
    (d2 / (MANIFEST_FILE + TMP_SUFFIX)).write_text("{}")
    # Crash of step 3 after the payload was moved but before the manifest was.
    d3 = _dir(tmp_path, 3)
    d3.mkdir()
    (d3 / PAYLOAD_FILE).write_bytes(b"\x00" * 8)
    assert store.list() == [1]
    ck = store.load_latest()
    assert ck is not None and ck.step == 1
    # A retry of the interrupted step succeeds and overwrites the leftover; older leftovers go away.
    store.save(3, {"w": torch.full((2,), 3.0)}, {"n": 3})
    assert store.list() == [1, 3] and not d2.exists()
    assert not any(p.name.endswith(TMP_SUFFIX) for p in d3.iterdir())
    assert store.load_latest().tensors["w"].tolist() == [3.0, 3.0]


def test_file_uri_and_plain_path_are_the_same_store(tmp_path):
    CheckpointStore(f"file://{tmp_path}", keep=5).save(1, {"w": torch.arange(3)}, {"via": "uri"})
    plain = CheckpointStore(str(tmp_path), keep=5)
    assert plain.list() == [1]
    plain.save(2, {"w": torch.arange(4)}, {"via": "path"})
    uri = CheckpointStore(f"file://{tmp_path}", keep=5)
    assert uri.list() == [1, 2] and uri.load(1).meta == {"via": "uri"}
    assert uri.load_latest().tensors["w"].tolist() == [0, 1, 2, 3]


def test_non_local_filesystem_uri(tmp_path):
    store = CheckpointStore("mock:///ckpt/run", keep=1)
    tensors = _tensors()
    store.save(1, tensors, {"a": 1})
    store.save(2, tensors, {"a": 2})
    assert store.list() == [2]
    ck = store.load_latest()
    assert ck.meta == {"a": 2}
    _assert_bitwise(ck.tensors, tensors)


class _Exploit:
    """Pickles to a call that creates a sentinel file when unpickled."""

    def __init__(self, sentinel: pathlib.Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


def _plant_payload(tmp_path: pathlib.Path, payload: bytes, dtype: str = "uint8") -> None:
    """Replace checkpoint 1's payload by `payload`, with a manifest that matches it exactly."""
    d = _dir(tmp_path, 1)
    (d / PAYLOAD_FILE).write_bytes(payload)
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    manifest.update(payload_sha256=hashlib.sha256(payload).hexdigest(), payload_bytes=len(payload),
                    tensors=[{"name": "w", "dtype": dtype, "shape": [len(payload)], "offset": 0,
                              "nbytes": len(payload)}])
    (d / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("pickler", ["pickle", "torch.save"])
def test_loading_never_runs_code_from_the_checkpoint(tmp_path, pickler):
    sentinel = tmp_path / "pwned"
    exploit = _Exploit(sentinel)
    if pickler == "pickle":
        payload = pickle.dumps({"w": exploit})
    else:
        torch.save({"w": exploit}, tmp_path / "evil.pt")
        payload = (tmp_path / "evil.pt").read_bytes()
    store = CheckpointStore(str(tmp_path / "store"))
    store.save(1, {"w": torch.zeros(1)}, {})
    _plant_payload(tmp_path / "store", payload)
    # The format can only express bytes: the pickle comes back as inert uint8 data.
    ck = store.load(1)
    assert bytes(ck.tensors["w"].tolist()) == payload
    assert not sentinel.exists()
    # Control: the planted payload is live, so the assertion above is not vacuous.
    if pickler == "pickle":
        pickle.loads(payload)
    else:
        torch.load(tmp_path / "evil.pt", weights_only=False)
    assert sentinel.exists()


def test_manifest_cannot_name_a_non_tensor_dtype(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(1, {"w": torch.zeros(1)}, {})
    _plant_payload(tmp_path, pickle.dumps([1, 2]), dtype="object")
    with pytest.raises(CheckpointError, match="dtype 'object'"):
        store.load(1)


def test_a_run_hands_actors_absolute_checkpoint_paths(tmp_path, monkeypatch):
    # Actors run in the Ray worker's working directory: a relative path would point elsewhere there.
    from orchestrator.core.checkpoint import run_checkpoint_uri

    monkeypatch.chdir(tmp_path)
    assert run_checkpoint_uri("runs/x/checkpoints", "elsewhere") == str(tmp_path / "runs" / "x" / "checkpoints")
    assert run_checkpoint_uri("s3://bucket/run/checkpoints", "elsewhere") == "s3://bucket/run/checkpoints"
    assert run_checkpoint_uri(f"file://{tmp_path}/c", "elsewhere") == f"file://{tmp_path}/c"
    # Unset: the run directory's checkpoints/, absolute too.
    assert run_checkpoint_uri(None, "runs/y") == str(tmp_path / "runs" / "y" / "checkpoints")
