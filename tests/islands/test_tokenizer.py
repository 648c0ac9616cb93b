"""Tests for islands.tokenizer and the document loaders of islands.data: local BPE training, text
encoders (bytes, tokenizers, user functions), and corpora tokenized through them."""

import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from islands.data import DataError, load_parquet_corpus, load_stdlib_corpus, parquet_texts, stdlib_texts, tokenize_corpus
from islands.tokenizer import (
    EOS_TOKEN,
    ByteEncoder,
    FunctionEncoder,
    TokenizersEncoder,
    load_tokenizer,
    text_encoder,
    train_tokenizer,
)

# Tests that train or load a tokenizer need the optional extra; the byte and function encoders do not.
needs_hf = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                              reason="needs the hf extra: pip install 'decoupled-diloco[hf]'")

UNICODE = "héllo wörld 日本語 🙂 \x00\ttabs\r\n  two spaces, a trailing space "


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


def char_ids(text: str) -> list[int]:
    """A user encoder: one id per character, ids shifted by one so 0 can end documents."""
    return [ord(c) + 1 for c in text]


def char_text(ids: list[int]) -> str:
    return "".join(chr(i - 1) for i in ids if i)


@pytest.fixture(scope="module")
def stdlib_sample() -> tuple[list[str], list[str], str]:
    return stdlib_texts(max_bytes=200_000)


@pytest.fixture(scope="module")
def bpe(stdlib_sample):
    return train_tokenizer(stdlib_sample[0], vocab_size=1000)


# --- Training and loading ---------------------------------------------------------------------------


@needs_hf
def test_training_is_deterministic_and_respects_vocab_size(stdlib_sample, bpe) -> None:
    again = train_tokenizer(stdlib_sample[0], vocab_size=1000)
    assert again.to_str() == bpe.to_str()  # same merges, same ids
    assert bpe.get_vocab_size() == 1000  # enough text to fill it
    assert bpe.token_to_id(EOS_TOKEN) == 0
    tiny = train_tokenizer(["ab ab ab"], vocab_size=5000)  # runs out of pairs: fewer, never more
    assert 257 <= tiny.get_vocab_size() < 300
    other = train_tokenizer(stdlib_sample[0], vocab_size=600)
    assert other.get_vocab_size() == 600


@needs_hf
def test_round_trip_is_exact_on_stdlib_text_and_unicode(stdlib_sample, bpe) -> None:
    encoder = TokenizersEncoder(bpe)
    docs = stdlib_sample[0] + stdlib_sample[1] + [UNICODE, f"two docs{EOS_TOKEN}in one", ""]
    ids = encoder.encode_batch(docs)
    assert [encoder.decode(i) for i in ids] == docs
    assert encoder.encode(UNICODE) == ids[-3]
    assert encoder.encode(f"a{EOS_TOKEN}b")[1] == encoder.eos_id  # the literal token is the special id
    # BPE compresses source code well below one token per byte.
    assert sum(map(len, ids)) < 0.45 * sum(len(d.encode()) for d in docs)


@needs_hf
def test_training_rejects_bad_arguments() -> None:
    with pytest.raises(DataError) as exc:
        train_tokenizer(["text"], vocab_size=256)
    assert "vocab_size=256 is too small" in one_line(exc) and ">= 257" in str(exc.value)
    with pytest.raises(DataError) as exc:
        train_tokenizer("one long text", vocab_size=300)
    assert "pass an iterable of documents" in one_line(exc)


@needs_hf
def test_saved_tokenizer_loads_back_from_file_or_folder(tmp_path: Path, bpe) -> None:
    TokenizersEncoder(bpe).save(tmp_path / "tokenizer.json")
    for path in (tmp_path / "tokenizer.json", tmp_path, str(tmp_path)):
        assert load_tokenizer(path).encode(UNICODE).ids == bpe.encode(UNICODE).ids
    loaded = text_encoder(str(tmp_path / "tokenizer.json"))
    assert isinstance(loaded, TokenizersEncoder) and loaded.eos_id == 0 and loaded.vocab_size == 1000
    assert "tokenizer.json" in loaded.name


@needs_hf
def test_loading_a_missing_or_invalid_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "missing.json")
    assert "missing.json' does not exist" in one_line(exc) and "train_tokenizer" in str(exc.value)
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path)  # a folder without tokenizer.json
    assert "tokenizer.json' does not exist" in one_line(exc)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError) as exc:
        load_tokenizer(tmp_path / "bad.json")
    assert "cannot read" in one_line(exc) and "as a tokenizer.json" in str(exc.value)
    (tmp_path / "junk.json").write_bytes(b"\xff\x00 not json")
    with pytest.raises(DataError) as exc:
        text_encoder(tmp_path / "junk.json")
    assert "cannot read" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder(str(tmp_path / "nope.json"))
    assert "nope.json' does not exist" in one_line(exc)


def test_missing_tokenizers_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(ImportError) as exc:
        train_tokenizer(["text"], vocab_size=300)
    assert "pip install 'decoupled-diloco[hf]'" in one_line(exc)
    with pytest.raises(ImportError, match=r"decoupled-diloco\[hf\]"):
        load_tokenizer("anything.json")
    assert text_encoder().encode("ok") == [111, 107]  # bytes need no tokenizers


# --- Encoders ---------------------------------------------------------------------------------------


def test_byte_encoder_is_the_default_and_replaces_invalid_utf8() -> None:
    for spec in (None, "bytes"):
        encoder = text_encoder(spec)
        assert isinstance(encoder, ByteEncoder) and (encoder.vocab_size, encoder.eos_id) == (256, 10)
    encoder = ByteEncoder()
    assert encoder.decode(encoder.encode(UNICODE)) == UNICODE
    assert encoder.decode([0xFF, 65]) == "\ufffdA"
    assert encoder.encode_documents(["ab", "c"]).tolist() == [97, 98, 10, 99]
    with pytest.raises(DataError, match=r"byte ids must be in \[0, 256\)"):
        encoder.decode([300])


@needs_hf
def test_tokenizer_without_a_known_end_token_must_name_one() -> None:
    tokenizer = train_tokenizer(["some text, some more text"], vocab_size=300, eos_token="<|end|>")
    with pytest.raises(DataError) as exc:
        TokenizersEncoder(tokenizer)
    assert "no end-of-document token" in one_line(exc) and "'<|end|>'" in str(exc.value)
    encoder = text_encoder(tokenizer, eos_token="<|end|>")
    assert encoder.eos_id == 0 and encoder.decode(encoder.encode_documents(["a", "b"]).tolist()) == "a<|end|>b"


def test_user_function_by_import_path_or_callable(tmp_path: Path) -> None:
    path = f"{__name__}:char_ids"
    for spec in (path, char_ids):
        encoder = text_encoder(spec, vocab_size=0x110001, eos_id=0, decode=char_text)
        assert isinstance(encoder, FunctionEncoder)
        assert encoder.encode("hé") == [ord("h") + 1, ord("é") + 1]
        assert encoder.decode(encoder.encode(UNICODE)) == UNICODE
        assert encoder.encode_documents(["a", "b"]).tolist() == [98, 0, 99]
        restored = pickle.loads(pickle.dumps(encoder))  # an island receives it pickled
        assert restored.encode(UNICODE) == encoder.encode(UNICODE)
        encoder.save(tmp_path / "encoder.json")
        loaded = text_encoder(tmp_path / "encoder.json")
        assert loaded.encode(UNICODE) == encoder.encode(UNICODE) and loaded.decode([105]) == "h"
    ByteEncoder().save(tmp_path / "bytes.json")
    assert isinstance(text_encoder(str(tmp_path / "bytes.json")), ByteEncoder)


def test_user_function_errors_name_the_fix() -> None:
    with pytest.raises(DataError) as exc:
        text_encoder(char_ids, eos_id=0)
    assert "needs vocab_size=" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder(char_ids, vocab_size=10)
    assert "needs eos_id=" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder("no_such_module_xyz:encode", vocab_size=10, eos_id=0)
    assert "cannot import module 'no_such_module_xyz'" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder(f"{__name__}:no_such_function", vocab_size=10, eos_id=0)
    assert "has no 'no_such_function'" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder(f"{__name__}:UNICODE", vocab_size=10, eos_id=0)
    assert "is a str, not a function" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder("no-such-file")
    assert "not an existing tokenizer file" in one_line(exc)
    with pytest.raises(DataError) as exc:
        text_encoder(42)
    assert "type int is not supported" in one_line(exc)
    lambda_encoder = text_encoder(lambda text: [1, 2], vocab_size=10, eos_id=0)
    with pytest.raises(DataError) as exc:
        lambda_encoder.decode([1])
    assert "has no decode function" in one_line(exc)
    with pytest.raises(DataError) as exc:
        lambda_encoder.save("unused.json")
    assert "has no import path" in one_line(exc) and "'module:function'" in str(exc.value)
    with pytest.raises(DataError) as exc:
        text_encoder(lambda text: "abc", vocab_size=10, eos_id=0).encode("x")
    assert "must return a list of ints" in one_line(exc)


# --- Corpora through a tokenizer --------------------------------------------------------------------


def test_stdlib_texts_are_the_byte_corpus_files_in_the_same_order() -> None:
    cap = 300_000
    corpus = load_stdlib_corpus(heldout_fraction=0.05, max_bytes=cap)
    train_docs, heldout_docs, source = stdlib_texts(heldout_fraction=0.05, max_bytes=cap)
    # The byte corpus is these documents joined by "\n" and cut at the cap (whole files here).
    for docs, array in ((train_docs, corpus.train), (heldout_docs, corpus.heldout)):
        text = array.tobytes().decode("utf-8", errors="replace")
        joined = "\n".join(docs)
        assert joined.startswith(text) and len(joined.encode()) - len(docs[-1].encode()) <= len(array)
    assert "standard library" in source and "files shuffled" in source
    assert stdlib_texts(heldout_fraction=0.05, max_bytes=cap)[0] == train_docs


def test_bytes_through_tokenize_corpus_equal_the_byte_parquet_corpus(tmp_path: Path) -> None:
    rows = [None if i % 41 == 0 else f"row {i} says héllo" for i in range(400)]
    path = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": rows}), path)
    for shuffle in (True, False):
        train_docs, heldout_docs, source = parquet_texts(str(path), text_column="text", heldout_fraction=0.2,
                                                         shuffle_documents=shuffle)
        corpus = tokenize_corpus(train_docs, heldout_docs, ByteEncoder(), source)
        expected = load_parquet_corpus(str(path), text_column="text", heldout_fraction=0.2, shuffle_documents=shuffle)
        assert corpus.train.dtype == np.uint8 and corpus.vocab_size == 256 and corpus.train.flags.writeable
        assert corpus.train.tobytes() == expected.train.tobytes()
        assert corpus.heldout.tobytes() == expected.heldout.tobytes()
        assert corpus.source.startswith(expected.source) and "UTF-8 bytes" in corpus.source
    with pytest.raises(DataError, match="column 'body' not found"):
        parquet_texts(str(path), text_column="body")


@needs_hf
def test_one_megabyte_of_stdlib_tokenizes_whole_and_in_order(bpe) -> None:
    # How fast: benchmarks/tokenize_speed.py (timings are measured there, not asserted here).
    train_docs, heldout_docs, source = stdlib_texts(max_bytes=1_000_000)
    encoder = TokenizersEncoder(bpe)
    corpus = tokenize_corpus(train_docs, heldout_docs, encoder, source)
    assert corpus.train.dtype == np.int32 and corpus.vocab_size == 1000
    assert corpus.train.max() < 1000 and "tokenizers BPE" in corpus.source
    # Documents joined by the end token, in order, nothing lost.
    assert encoder.decode(corpus.heldout.tolist()) == EOS_TOKEN.join(heldout_docs)
    assert int((corpus.train == 0).sum()) == len(train_docs) - 1 + sum(d.count(EOS_TOKEN) for d in train_docs)


def test_tokenize_corpus_rejects_bad_ids_and_short_splits() -> None:
    wide = FunctionEncoder(char_ids, vocab_size=100, eos_id=0)
    with pytest.raises(DataError) as exc:
        tokenize_corpus(["ab"], ["é", "a"], wide, "test")
    assert "gave ids in [0, 234] but vocab_size=100" in one_line(exc) and "vocab_size=235" in str(exc.value)
    with pytest.raises(DataError) as exc:
        tokenize_corpus(["abcdef"], ["d"], ByteEncoder(), "test", seq_len=4)
    assert "held-out split has 1 tokens from 1 documents" in one_line(exc)
    with pytest.raises(DataError) as exc:
        tokenize_corpus("abc", ["d"], ByteEncoder(), "test")
    assert "one string" in one_line(exc)
