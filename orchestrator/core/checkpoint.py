"""Checkpoint store: numbered checkpoints of named tensors plus JSON metadata on any pyarrow filesystem.

Format (version 1). Each checkpoint is a directory `ROOT/step-<step, 12 digits>/` with two files:

- `tensors.bin`: the raw bytes of every tensor, C-contiguous, native little-endian, each starting at
  a 64-byte aligned offset (zero padding between), in manifest order.
- `manifest.json`: `{"format", "step", "meta", "payload_sha256", "payload_bytes", "tensors": [{"name",
  "dtype", "shape", "offset", "nbytes"}]}`.

Why raw bytes plus JSON rather than `torch.save`: the reader only ever turns bytes into tensors of a
whitelisted dtype, so a checkpoint cannot express code, whatever `torch.load`'s unpickler allows in
a given release; the layout is documented here, readable without torch, and needs no extra package
(`safetensors` is not installed). Arrow IPC would add nothing: tensors are opaque byte ranges here.

Commit protocol: the payload is written under a temporary name and moved into place, then the
manifest likewise. The manifest is the commit point: a directory without one is an interrupted save
and is invisible to `list`/`load`. On local disks the moves are atomic renames; on object stores
(S3, GCS) a move is copy+delete, but each object appears whole, and the manifest is still written
last, so a reader never sees a manifest whose payload is unwritten. The manifest carries the payload's
sha256, so a payload damaged afterwards is detected on load. One writer per store is assumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PAYLOAD_FILE = "tensors.bin"
MANIFEST_FILE = "manifest.json"
TMP_SUFFIX = ".tmp"
_ALIGN = 64  # bytes; keeps every tensor's offset a multiple of any element size, so views need no copy
_DIR_RE = re.compile(r"^step-(\d+)$")
# Only these dtypes can be stored; a manifest naming anything else is rejected on load.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                 "complex64", "complex128", "int64", "int32", "int16", "int8",
                 "uint64", "uint32", "uint16", "uint8", "bool")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


# A run's global parameters are stored as PARAM_PREFIX + their model name (other tensors of the outer
# optimizer's state sit beside them under other prefixes).
PARAM_PREFIX = "param/"
# Under run.average_window, the served model (a moving average of the global parameters) beside them.
AVERAGE_PREFIX = "average/"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the checkpoint and the fix."""


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint.

    `step` is the caller's checkpoint number, `tensors` maps names to CPU tensors with the saved
    dtype and shape, `meta` is the saved JSON metadata, `path` the checkpoint directory it came from.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    path: str

    def parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters by model name: the tensors stored under :data:`PARAM_PREFIX`."""
        return self._by_model_name(PARAM_PREFIX)

    def average_parameters(self) -> dict[str, torch.Tensor]:
        """The moving average of the global parameters by model name (:data:`AVERAGE_PREFIX`), empty when
        the run kept none (`run.average_window`)."""
        return self._by_model_name(AVERAGE_PREFIX)

    def _by_model_name(self, prefix: str) -> dict[str, torch.Tensor]:
        return {name[len(prefix):]: t for name, t in self.tensors.items() if name.startswith(prefix)}


def run_checkpoint_uri(configured: str | None, run_dir: str | os.PathLike) -> str:
    """Where a run's checkpoints live: `checkpoint.uri` as configured (a local path made absolute, a
    URI with a scheme unchanged), or RUN_DIR/checkpoints when it is None.

    Absolute because the actors that write there run in the Ray worker's working directory, not the
    driver's."""
    if configured is None:
        return str(Path(run_dir).expanduser().resolve() / "checkpoints")
    return configured if "://" in configured else str(Path(configured).expanduser().resolve())


def checkpoint_dirname(step: int) -> str:
    """The directory name, relative to the store root, of checkpoint `step`."""
    return f"step-{step:012d}"


class CheckpointStore:
    """Saves and loads numbered checkpoints under one directory, keeping only the newest `keep`."""

    def __init__(self, uri: str, *, keep: int | None = None) -> None:
        """Open (creating if missing) the store at `uri`: a local path or a pyarrow.fs URI
        (`file:///x`, `s3://bucket/prefix`, `gs://...`, `mock:///x`).

        `keep`: how many complete checkpoints a save leaves (older ones are deleted); None prunes none, for a
        store opened to read. Every writer of a run passes the config's ``checkpoint.keep``
        (orchestrator/settings.py, `outer_checkpoints`), so the retention is declared once, in the config."""
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r} must be an int >= 1; pass how many checkpoints to retain")
        self.uri = uri
        self.keep = keep
        if "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(uri)
        self.root = self.root.rstrip("/") or "/"
        self.fs.create_dir(self.root, recursive=True)

    def _dir(self, step: int) -> str:
        return f"{self.root}/{checkpoint_dirname(step)}"

    def _scan(self) -> tuple[list[int], list[int]]:
        """Steps of (complete, incomplete) checkpoint directories, each ascending."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        steps = sorted(int(m.group(1)) for i in infos
                       if i.type == pafs.FileType.Directory and (m := _DIR_RE.match(i.base_name)))
        manifests = self.fs.get_file_info([f"{self._dir(s)}/{MANIFEST_FILE}" for s in steps])
        done = {s for s, m in zip(steps, manifests) if m.type == pafs.FileType.File}
        return [s for s in steps if s in done], [s for s in steps if s not in done]

    def list(self) -> list[int]:
        """Steps of complete checkpoints (manifest present; not yet verified), ascending."""
        return self._scan()[0]

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict) -> str:
        """Write checkpoint `step` atomically, delete all but the newest `keep`, return its path.

        `step` must exceed every existing checkpoint's step. Tensors are saved as contiguous CPU
        copies (views and non-contiguous tensors are fine); `meta` must be JSON-serializable (tuples
        come back as lists).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r} must be an int >= 0; pass the checkpoint number")
        existing = self.list()
        if existing and step <= existing[-1]:
            raise CheckpointError(f"step={step} must be larger than the newest checkpoint step {existing[-1]} "
                                  f"in {self.uri}; pass a larger step")
        try:
            meta_json = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"meta for step {step} is not JSON-serializable ({e}); "
                                  "pass only dicts, lists, str, numbers, bools, None") from e
        if not isinstance(meta_json, dict):
            raise CheckpointError(f"meta for step {step} is a {type(meta).__name__}; pass a dict")
        if sys.byteorder != "little":  # the format is little-endian; refuse rather than write garbage
            raise CheckpointError(f"cannot save on a {sys.byteorder}-endian host; use a little-endian host")

        path = self._dir(step)
        # A leftover of an interrupted save of this same step (no manifest) is overwritten.
        self.fs.create_dir(path, recursive=True)
        entries, sha, offset = [], hashlib.sha256(), 0
        tmp_payload = f"{path}/{PAYLOAD_FILE}{TMP_SUFFIX}"
        with self.fs.open_output_stream(tmp_payload) as out:
            for name, t in tensors.items():
                flat = _to_bytes(step, name, t)
                pad = -offset % _ALIGN
                if pad:
                    out.write(b"\0" * pad)
                    sha.update(b"\0" * pad)
                    offset += pad
                view = memoryview(flat.numpy())  # type: ignore[arg-type]  # ndarray is a buffer; numpy declares __buffer__ only on 3.12+
                out.write(view)
                sha.update(view)
                entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                "shape": list(t.shape), "offset": offset, "nbytes": flat.numel()})
                offset += flat.numel()
        self.fs.move(tmp_payload, f"{path}/{PAYLOAD_FILE}")
        manifest = {"format": FORMAT_VERSION, "step": step, "meta": meta_json, "payload_sha256": sha.hexdigest(),
                    "payload_bytes": offset, "tensors": entries}
        tmp_manifest = f"{path}/{MANIFEST_FILE}{TMP_SUFFIX}"
        with self.fs.open_output_stream(tmp_manifest) as out:
            out.write(json.dumps(manifest, indent=1).encode())
        self.fs.move(tmp_manifest, f"{path}/{MANIFEST_FILE}")  # commit point
        log.info("saved checkpoint step %d: %d tensors, %d bytes at %s", step, len(entries), offset, path)
        self._prune(step)
        return path

    def _prune(self, newest: int) -> None:
        """Delete complete checkpoints beyond the newest `keep` (none when None), and interrupted saves older
        than `newest`."""
        complete, incomplete = self._scan()
        for s in complete[:-self.keep] if self.keep is not None else []:
            # Manifest first: a crash mid-delete leaves an (ignored) incomplete dir, never a manifest
            # whose payload is gone.
            self.fs.delete_file(f"{self._dir(s)}/{MANIFEST_FILE}")
            self.fs.delete_dir(self._dir(s))
            log.info("deleted checkpoint step %d: keeping the newest %d", s, self.keep)
        for s in incomplete:
            if s < newest:
                self.fs.delete_dir(self._dir(s))
                log.info("deleted interrupted save of step %d at %s", s, self._dir(s))

    def load(self, step: int) -> Checkpoint:
        """Load and verify checkpoint `step`; CheckpointError if it is missing or corrupt."""
        path = self._dir(step)
        try:
            with self.fs.open_input_file(f"{path}/{MANIFEST_FILE}") as f:
                manifest = json.loads(f.read())
        except FileNotFoundError as e:
            raise CheckpointError(f"checkpoint step {step} not found at {path}; use one of {self.list()}") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint {path} has an unreadable manifest ({e}); delete it") from e
        try:
            return self._load(step, path, manifest)
        except CheckpointError:
            raise
        except (FileNotFoundError, KeyError, TypeError, ValueError, RuntimeError, OSError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e}); delete it") from e

    def _load(self, step: int, path: str, manifest: dict) -> Checkpoint:
        if not isinstance(manifest, dict):
            raise CheckpointError(f"checkpoint {path} manifest is a {type(manifest).__name__}, "
                                  "not an object; delete it")
        if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
            raise CheckpointError(f"checkpoint {path} has format={manifest.get('format')!r} "
                                  f"step={manifest.get('step')!r}, expected {FORMAT_VERSION} and {step}; delete it")
        size = manifest["payload_bytes"]
        payload_path = f"{path}/{PAYLOAD_FILE}"
        with self.fs.open_input_file(payload_path) as f:
            if f.size() != size:
                raise CheckpointError(f"checkpoint {path} payload is {f.size()} bytes, manifest says {size}; "
                                      "it is truncated or damaged, delete it")
            payload = torch.empty(size, dtype=torch.uint8)
            buf, got = memoryview(payload.numpy()), 0  # type: ignore[arg-type]  # as in save: numpy's stubs, not the array
            while got < size:  # readinto may return short counts on remote filesystems
                n = f.readinto(buf[got:])
                if n == 0:
                    raise CheckpointError(f"checkpoint {path} payload ended at byte {got} of {size}; delete it")
                got += n
        digest = hashlib.sha256(buf).hexdigest()
        if digest != manifest["payload_sha256"]:
            raise CheckpointError(f"checkpoint {path} payload sha256 {digest[:12]}... does not match the "
                                  f"manifest's {str(manifest['payload_sha256'])[:12]}...; it is damaged, delete it")
        tensors: dict[str, torch.Tensor] = {}
        for e in manifest["tensors"]:
            name, dtype_name, shape, off, nbytes = e["name"], e["dtype"], e["shape"], e["offset"], e["nbytes"]
            dtype = _DTYPES.get(dtype_name)
            if dtype is None:
                raise CheckpointError(f"checkpoint {path} tensor {name!r} has dtype {dtype_name!r}; "
                                      f"only {sorted(_DTYPES)} can be loaded")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise CheckpointError(f"checkpoint {path} tensor {name!r} has shape {shape!r}; delete it")
            numel = 1
            for d in shape:
                numel *= d
            itemsize = torch.empty((), dtype=dtype).element_size()
            if nbytes != numel * itemsize or off < 0 or off % itemsize or off + nbytes > size:
                raise CheckpointError(f"checkpoint {path} tensor {name!r} has offset={off} nbytes={nbytes} "
                                      f"inconsistent with shape {shape} {dtype_name} and {size} payload bytes")
            # A view into the one payload buffer: no second copy of the checkpoint in memory.
            tensors[name] = payload[off:off + nbytes].view(dtype).reshape(shape)
        log.info("loaded checkpoint step %d: %d tensors from %s", step, len(tensors), path)
        return Checkpoint(step=step, tensors=tensors, meta=manifest["meta"], path=path)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; damaged ones are skipped with a WARNING. None if none."""
        for step in reversed(self.list()):
            try:
                return self.load(step)
            except CheckpointError as e:
                log.warning("skipping checkpoint step %d at %s: %s", step, self._dir(step), e)
        return None


def _to_bytes(step: int, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a flat contiguous uint8 CPU tensor (a copy only where layout requires one)."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"step {step} tensor {name!r} is a {type(t).__name__}; pass torch.Tensor values")
    if not isinstance(name, str):
        raise CheckpointError(f"step {step} tensor name {name!r} is not a str; use string keys")
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise CheckpointError(f"step {step} tensor {name!r} is {t.layout}/{t.device.type}; "
                              "convert it to a dense tensor with data first")
    if str(t.dtype).removeprefix("torch.") not in _DTYPES:
        raise CheckpointError(f"step {step} tensor {name!r} has dtype {t.dtype}; use one of {sorted(_DTYPES)}")
    # resolve_conj/neg: lazily conjugated/negated views must be materialized, or the bytes are wrong.
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)
