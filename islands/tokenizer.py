"""Text to token ids for the data path: UTF-8 bytes (the default), a Hugging Face ``tokenizers``
tokenizer, or a user function.

A :class:`TextEncoder` turns documents into ids and back, and knows its ``vocab_size`` and the
``eos_id`` that :func:`islands.data.tokenize_corpus` puts between documents. Build one with
:func:`text_encoder` from a config value (None, "bytes", a tokenizer.json path, "module:function",
a ``tokenizers.Tokenizer`` or a callable), or train a byte-level BPE with :func:`train_tokenizer`.

``tokenizers`` is the optional extra ``hf`` (``pip install 'decoupled-diloco[hf]'``): it is imported
only inside the functions that need it, so the project imports and byte corpora work without it.
Nothing is downloaded: tokenizers are trained locally or loaded from a local tokenizer.json.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from islands.data import DataError

if TYPE_CHECKING:
    import tokenizers

EOS_TOKEN = "<|endoftext|>"
"""The end-of-document special token of tokenizers trained by :func:`train_tokenizer`."""
# End-of-document tokens of common tokenizer.json files, tried in order when none is named.
_KNOWN_EOS_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
_BYTE_EOS = 10  # b"\n": byte corpora have always joined documents with a newline
_HF_INSTALL = "pip install 'decoupled-diloco[hf]'"
_SPEC_KEY = "text_encoder"  # marks a file written by save() for a byte or function encoder


def _import_tokenizers():
    """The ``tokenizers`` module, or a one-line ImportError naming the extra to install."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(f"the Hugging Face 'tokenizers' package is not installed; run "
                          f"{_HF_INSTALL} to train or load tokenizers") from exc
    return tokenizers


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, eos_token: str = EOS_TOKEN) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts``, locally and deterministically.

    Every byte is in the initial alphabet, so any text encodes and ``decode(encode(t)) == t``.
    ``eos_token`` is a special token (id 0) that ends documents. The vocabulary has at most
    ``vocab_size`` entries (fewer when the texts run out of pairs to merge); ``vocab_size`` must
    leave room for the 256 byte tokens and ``eos_token``. Same texts and size give the same
    tokenizer.
    """
    tk = _import_tokenizers()
    if isinstance(texts, (str, bytes)):
        raise DataError("train_tokenizer got one string as texts; pass an iterable of documents, e.g. [text]")
    minimum = 256 + 1  # the byte alphabet and the end-of-document token
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < minimum:
        raise DataError(f"vocab_size={vocab_size!r} is too small for a byte-level BPE; pass an int "
                        f">= {minimum} (256 bytes + {eos_token!r})")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    # No prefix space: a leading space would be added to every document and break round trips.
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _tokenizer_file(path: str | os.PathLike) -> pathlib.Path:
    """``path`` itself, or the tokenizer.json inside a directory (a Hugging Face model folder)."""
    file = pathlib.Path(path).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"tokenizer file {str(file)!r} does not exist; pass the tokenizer.json written by "
                        f"train_tokenizer(...).save(path) or TextEncoder.save(path)")
    return file


def load_tokenizer(path: str | os.PathLike) -> tokenizers.Tokenizer:
    """Load a ``tokenizers`` tokenizer from a tokenizer.json file (or a directory holding one).

    Raises :class:`DataError` when the file is missing or is not a valid tokenizer.json.
    """
    tk = _import_tokenizers()
    file = _tokenizer_file(path)
    try:
        return tk.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"cannot read {str(file)!r} as a tokenizer.json ({reason}); save it again with "
                        f"Tokenizer.save or train one with train_tokenizer") from exc


def _join_documents(ids: Iterable[Sequence[int] | np.ndarray], eos_id: int) -> np.ndarray:
    """Each document's ids, with ``eos_id`` between documents (not after the last), as int64."""
    eos = np.array([eos_id], dtype=np.int64)
    pieces: list[np.ndarray] = []
    for i, doc in enumerate(ids):
        if i:
            pieces.append(eos)
        pieces.append(np.asarray(doc, dtype=np.int64).reshape(-1))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


class TextEncoder:
    """Documents to token ids and back. Subclasses: :class:`ByteEncoder`, :class:`TokenizersEncoder`,
    :class:`FunctionEncoder`; build one with :func:`text_encoder`. Instances pickle (for Ray)."""

    vocab_size: int
    """Every id is in ``[0, vocab_size)``."""
    eos_id: int
    """The id put between documents by :meth:`encode_documents`."""
    name: str
    """Human description, for corpus sources and logs."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text."""
        raise NotImplementedError

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """All documents' ids joined with :attr:`eos_id` between them, as a 1-D integer array."""
        return _join_documents(self.encode_batch(texts), self.eos_id)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens included, so the end-of-document token shows)."""
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        """Write this encoder to ``path`` (a JSON file) so :func:`text_encoder` can load it back."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteEncoder(TextEncoder):
    """UTF-8 bytes as ids (vocab 256), the default. Documents are joined with b"\\n" (``eos_id=10``),
    as the byte corpora always were; :meth:`decode` replaces invalid UTF-8 with U+FFFD."""

    vocab_size = 256
    eos_id = _BYTE_EOS
    name = "UTF-8 bytes"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        # One join in C instead of a list of ints per byte (the full stdlib is 31 MB); a bytearray,
        # so the array is writable like the byte loaders' arrays.
        joined = bytearray([self.eos_id]).join(text.encode("utf-8") for text in texts)
        return np.frombuffer(joined, dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError as exc:
            raise DataError(f"byte ids must be in [0, 256) ({exc}); decode ids of this encoder only") from exc

    def save(self, path: str | os.PathLike) -> None:
        pathlib.Path(path).write_text(json.dumps({_SPEC_KEY: "bytes"}) + "\n")


class TokenizersEncoder(TextEncoder):
    """A Hugging Face ``tokenizers.Tokenizer``. Encoding adds no special tokens (no per-document
    BOS from a post-processor): documents are separated by ``eos_token`` alone."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str | None = None, origin: str = "") -> None:
        """``eos_token`` ends documents; None picks the first of "<|endoftext|>", "</s>",
        "<|end_of_text|>", "<eos>" that the tokenizer has. ``origin`` (a path) goes into :attr:`name`."""
        self.tokenizer = tokenizer
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOS_TOKENS
        ids = [(token, tokenizer.token_to_id(token)) for token in candidates]
        found = [(token, i) for token, i in ids if i is not None]
        if not found:
            special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values())[:8]
            raise DataError(f"tokenizer has no end-of-document token {' or '.join(map(repr, candidates))}; "
                            f"pass eos_token= one of its tokens (special tokens: {special})")
        self.eos_token, self.eos_id = found[0]
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        model = type(tokenizer.model).__name__
        self.name = f"tokenizers {model}" + (f" from {origin}" if origin else "")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch runs in parallel in Rust: a 1 MB corpus takes about a second on 2 cores.
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer.json (readable by :func:`load_tokenizer` and Hugging Face tools)."""
        self.tokenizer.save(str(path))


def _resolve_import(path: str, what: str) -> Callable:
    """The callable named by "module:attribute" (the attribute may be dotted)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise DataError(f"{what} {path!r} is not an import path; write it as 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise DataError(f"cannot import module {module_name!r} for {what} {path!r} ({exc}); check the "
                        f"import path and that the module is installed on every node") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise DataError(f"module {module_name!r} has no {attribute!r} for {what} {path!r}; check the name")
        target = getattr(target, part)
    if not callable(target):
        raise DataError(f"{what} {path!r} is a {type(target).__name__}, not a function; name a function")
    return target


def _import_path_of(function: Callable) -> str | None:
    """"module:qualname" that imports back to ``function``, or None (lambdas, closures)."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    path = f"{module}:{qualname}"
    try:
        return path if _resolve_import(path, "function") is function else None
    except DataError:
        return None


class FunctionEncoder(TextEncoder):
    """A user function ``str -> list[int]``, given as a callable or an import path "module:function"
    (a module-level function, so an island process can import it). ``vocab_size`` and ``eos_id``
    must be given; ``decode`` (``list[int] -> str``) is optional."""

    def __init__(self, encode: Callable[[str], Sequence[int]] | str, *, vocab_size: int | None, eos_id: int | None,
                 decode: Callable[[Sequence[int]], str] | str | None = None) -> None:
        label = encode if isinstance(encode, str) else getattr(encode, "__qualname__", repr(encode))
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
            raise DataError(f"encoder function {label!r} needs vocab_size= a positive int (got {vocab_size!r}); "
                            f"pass the size of its id range")
        if not isinstance(eos_id, int) or isinstance(eos_id, bool) or not 0 <= eos_id < vocab_size:
            raise DataError(f"encoder function {label!r} needs eos_id= an int in [0, vocab_size={vocab_size}) "
                            f"(got {eos_id!r}); pass the id that ends a document")
        self._encode = self._callable(encode, "encode function")
        self._decode = None if decode is None else self._callable(decode, "decode function")
        # The import paths, for save(): given, or found for module-level functions (None for lambdas).
        self._paths = {key: value if isinstance(value, str) else None if value is None else _import_path_of(value)
                       for key, value in (("encode", encode), ("decode", decode))}
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.name = f"function {label}"

    @staticmethod
    def _callable(value: Callable | str, what: str) -> Callable:
        if isinstance(value, str):
            return _resolve_import(value, what)  # fails now, in the driver, not later in an island
        if not callable(value):
            raise DataError(f"{what} is a {type(value).__name__}; pass a callable or 'module:function'")
        return value

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = self._encode(text)
            try:
                out.append([int(i) for i in ids])
            except (TypeError, ValueError) as exc:
                raise DataError(f"{self.name} returned {type(ids).__name__} ({exc}); it must return a list "
                                f"of ints") from exc
        return out

    def decode(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            raise DataError(f"{self.name} has no decode function; pass decode= a callable or 'module:function'")
        return self._decode(list(ids))

    def save(self, path: str | os.PathLike) -> None:
        for key, function in (("encode", self._encode), ("decode", self._decode)):
            if function is not None and self._paths[key] is None:
                raise DataError(f"{key} function {function!r} has no import path; pass it as "
                                f"'module:function' to save this encoder")
        spec = {_SPEC_KEY: "function", **self._paths, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        pathlib.Path(path).write_text(json.dumps(spec) + "\n")


def _load_saved(file: pathlib.Path) -> TextEncoder | None:
    """The encoder of a file written by ByteEncoder/FunctionEncoder.save, or None for other JSON."""
    try:
        spec = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError):
        return None  # load_tokenizer gives the error
    if not isinstance(spec, dict) or _SPEC_KEY not in spec:
        return None
    if spec[_SPEC_KEY] == "bytes":
        return ByteEncoder()
    if spec[_SPEC_KEY] == "function":
        encode: Any = spec.get("encode")  # a file's value: FunctionEncoder raises DataError for a missing or bad one
        return FunctionEncoder(encode, vocab_size=spec.get("vocab_size"), eos_id=spec.get("eos_id"),
                               decode=spec.get("decode"))
    raise DataError(f"{str(file)!r} names text_encoder={spec[_SPEC_KEY]!r}; expected 'bytes' or 'function'")


def text_encoder(spec: Any = None, *, vocab_size: int | None = None, eos_id: int | None = None,
                 decode: Callable | str | None = None, eos_token: str | None = None) -> TextEncoder:
    """The :class:`TextEncoder` for a config value ``spec``:

    - None or "bytes": UTF-8 bytes (vocab 256), the default;
    - a :class:`TextEncoder`: itself;
    - a ``tokenizers.Tokenizer``: wrapped, ``eos_token`` naming its end-of-document token;
    - a path to a tokenizer.json (or a folder holding one) or to a file written by
      :meth:`TextEncoder.save`: loaded;
    - a callable or import path "module:function" (``str -> list[int]``): a :class:`FunctionEncoder`,
      which needs ``vocab_size`` and ``eos_id`` (and optionally ``decode``).
    """
    if spec is None or spec == "bytes":
        return ByteEncoder()
    if isinstance(spec, TextEncoder):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        file = pathlib.Path(text).expanduser()
        if file.exists() or text.endswith(".json"):
            file = _tokenizer_file(file)  # a one-line error for a missing .json
            saved = _load_saved(file)
            if saved is not None:
                return saved
            return TokenizersEncoder(load_tokenizer(file), eos_token=eos_token, origin=str(file))
        if ":" in text:
            return FunctionEncoder(text, vocab_size=vocab_size, eos_id=eos_id, decode=decode)
        raise DataError(f"text encoder {text!r} is not an existing tokenizer file or a 'module:function' "
                        f"import path; pass 'bytes', a tokenizer.json path or 'module:function'")
    if type(spec).__module__.startswith("tokenizers"):
        return TokenizersEncoder(spec, eos_token=eos_token)
    if callable(spec):
        return FunctionEncoder(spec, vocab_size=vocab_size, eos_id=eos_id, decode=decode)
    raise DataError(f"text encoder of type {type(spec).__name__} is not supported; pass 'bytes', a "
                    f"tokenizer.json path, a tokenizers.Tokenizer, or a function str -> list[int]")
