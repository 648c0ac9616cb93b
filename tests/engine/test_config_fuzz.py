"""Config fuzzing (issue 60): every field of RunConfig, at any depth and in every pool, given wrong types and
out-of-range values, through `build_config(dict)` and through `--set key=VALUE` (VALUE parsed as YAML).

The contract: a config is either accepted, and then it is a RunConfig that a run directory's config.yaml gives
back unchanged, or refused with a ConfigError whose text is one line that names the field (its dotted path, or
the pool's index or name) and is not pydantic's own dump. Any other exception is a failure: that is what the
fuzzing is for (a traceback instead of a line). The fields are read from the models, so a new field is fuzzed
as soon as it exists. A few `diloco train --set` runs in a subprocess check the same from the outside: exit
code 2, one line on stderr, and Ray never imported.

Hypothesis runs derandomized with a small number of examples per field (CI time); `-m extended` runs many more.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orchestrator.config import ConfigError, RunConfig, build_config, load_config
from orchestrator.config_errors import printable

ROOT = Path(__file__).resolve().parents[2]
# libyaml's safe loader and dumper where installed (the same YAML as yaml.safe_*, many times faster: CI time).
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

FAST = settings(max_examples=4, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))
EXTENDED = settings(FAST, max_examples=400)

DEFAULT_POOLS: list[dict[str, Any]] = RunConfig().model_dump(mode="json")["pools"]
POOL_NAMES = [p["name"] for p in DEFAULT_POOLS]

# What pydantic's own str(ValidationError) carries, which a user should never see.
PYDANTIC_DUMP = ("For further information visit", "[type=", "input_value=", "input_type=", "validation error for")


# ------------------------------------------------------------------------------------------ the fields


@dataclass(frozen=True)
class ConfigField:
    """One field of the config: its path (`pools` entries as "*"), its FieldInfo and the model holding it."""

    path: tuple[str, ...]
    info: FieldInfo
    holder: type[BaseModel]

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def in_pool(self) -> bool:
        return "*" in self.path


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model of a section (`run: RunSection`) or of a list's entries (`pools: list[PoolConfig]`); else None."""
    if get_origin(annotation) is list and get_args(annotation):
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def config_fields(model: type[BaseModel] = RunConfig, prefix: tuple[str, ...] = ()) -> list[ConfigField]:
    """Every field of `model` at any depth, sections and lists of sections included (their entries as "*")."""
    out = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        out.append(ConfigField(path, info, model))
        inner = _section(info.annotation)
        if inner is not None:
            out += config_fields(inner, (*path, "*") if get_origin(info.annotation) is list else path)
    return out


FIELDS = config_fields()
# (path, model) of the config and of every section in it, pools as "*": where an unknown key can go.
SECTIONS: list[tuple[tuple[str, ...], type[BaseModel]]] = [((), RunConfig)] + [
    ((*f.path, "*") if get_origin(f.info.annotation) is list else f.path, m)
    for f in FIELDS if (m := _section(f.info.annotation)) is not None]


def test_the_walk_reaches_every_section_and_every_pool_field():
    dotted = {f.dotted for f in FIELDS}
    assert {"mode", "run.seed", "outer.min_quorum", "data.source", "pools", "pools.*.islands", "pools.*.resources",
            "network.scenario"} <= dotted
    assert {p for p, _ in SECTIONS} >= {(), ("run",), ("outer",), ("pools", "*")}
    assert len(FIELDS) > 100


# ------------------------------------------------------------------------------------------ the values


def _literals(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return [v for a in get_args(annotation) for v in _literals(a)]
    return []


def _bounds(info: FieldInfo) -> list[float]:
    out = []
    for m in info.metadata:
        for attr in ("gt", "ge", "lt", "le", "min_length"):
            v = getattr(m, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(v)
    return out


# The classes of wrong values every field gets (strings, lists, dicts, None, bools where numbers are, floats where
# ints are, NaN and inf, huge and negative numbers, empty strings, words no enum knows), one or two of each.
CLASSIC: list[Any] = [None, "", "bogus", "a\nb", [], [1, "x"], {}, {"x": 1}, True, 0, -1, 1.5, -0.0, math.nan, math.inf,
                      -math.inf, 2**63, -(10**30), "1e999"]


def field_values(f: ConfigField) -> list[Any]:
    """The fixed values `f` is given: CLASSIC, its bounds and either side of them, its enum words and near misses."""
    steps = (0, -1, 1, -1e-9, 1e-9) if float in (f.info.annotation, *get_args(f.info.annotation)) else (0, -1, 1)
    around = [b + d for b in _bounds(f.info) for d in steps]
    words = [w for w in _literals(f.info.annotation) if isinstance(w, str)]
    out: dict[str, Any] = {}
    for v in [*CLASSIC, *around, *words, *(w.upper() for w in words), *(w + "x" for w in words)]:
        out.setdefault(f"{type(v).__name__}:{v!r}", v)
    return list(out.values())


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=6), SCALARS, max_size=3))


def values_for(f: ConfigField) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(field_values(f)), VALUES)


def as_yaml(value: Any) -> str:
    """`value` written as the VALUE of `--set key=VALUE` (one YAML flow node, as a user would type it)."""
    text = yaml.dump(value, Dumper=DUMPER, default_flow_style=True, width=1 << 20)
    return text.removesuffix("\n...\n").removesuffix("\n")


# ------------------------------------------------------------------------------------------ the contract


def _nan_safe(cfg: RunConfig, mode: Literal["python", "json"] = "python") -> str:
    return repr(cfg.model_dump(mode=mode))  # NaN == NaN here, unlike RunConfig's ==


def one_line(msg: str) -> None:
    """A ConfigError's text as the CLI prints it: one line, not pydantic's dump."""
    assert msg and msg.splitlines() == [msg], f"not one line: {msg!r}"
    for fragment in PYDANTIC_DUMP:
        assert fragment not in msg, f"pydantic's own dump ({fragment!r}) in {msg!r}"


def names_field(msg: str, f: ConfigField, pool: int | None, value: Any) -> bool:
    """Whether `msg` names field `f`: its name, and for a pool's field the pool's index or name."""
    if f.path[-1] not in msg:
        return False
    if pool is None:
        return True
    named = [f"pools.{pool}", f"pools.{POOL_NAMES[pool]}", repr(POOL_NAMES[pool])]
    if f.path[-1] == "name":
        named.append(repr(value))  # a renamed pool is named by its new name
    return any(n in msg for n in named)


def check(build: Callable[..., RunConfig], *args: Any, where: tuple[ConfigField, int | None, Any] | None = None) -> None:
    """Run `build(*args)`: accepted, the config must round-trip (in memory and as a run directory's config.yaml
    writes it); refused, one ConfigError line that names the field `where` gives (field, pool index, value)."""
    try:
        cfg = build(*args)
    except ConfigError as err:
        msg = str(err)
        one_line(msg)
        if where is not None:
            f, pool, value = where
            assert names_field(msg, f, pool, value), f"{f.dotted} (pool {pool}) = {value!r}: not named in {msg!r}"
        return
    assert isinstance(cfg, RunConfig)
    again = build_config(cfg.model_dump(), recorded=True)
    assert _nan_safe(again) == _nan_safe(cfg)
    written = yaml.load(yaml.dump(cfg.model_dump(mode="json"), Dumper=DUMPER, sort_keys=False), Loader=LOADER)
    assert _nan_safe(build_config(written, recorded=True), "json") == _nan_safe(cfg, "json")


def as_dict(path: tuple[str, ...], value: Any, pool: int | None) -> dict[str, Any]:
    """A config dict that gives the field at `path` (of pool `pool`) `value`, and else only the default pools."""
    return put({}, path, value, pool)


def put(data: dict[str, Any], path: tuple[str, ...], value: Any, pool: int | None) -> dict[str, Any]:
    """`data` with the field at `path` set to `value`: a pool's field in pool `pool` of the pools `data` has (the
    default pools where it has none), a section made where `data` has none."""
    node = data
    for i, part in enumerate(path[:-1]):
        if part == "*":
            continue
        if path[i + 1] == "*":
            entries = node.get(part)
            if not (isinstance(entries, list) and len(entries) == len(DEFAULT_POOLS) and all(isinstance(e, dict) for e in entries)):
                entries = node[part] = [dict(p) for p in DEFAULT_POOLS]
            node = entries[pool or 0]
        else:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
    node[path[-1]] = value
    return data


def as_override(f: ConfigField, pool: int | None, by_name: bool) -> str:
    """The key of `--set key=VALUE` for field `f`, a pool's by its index or by its name."""
    pick = POOL_NAMES[pool] if by_name and pool is not None else str(pool)
    return ".".join(pick if p == "*" else p for p in f.path)


IDS = [f.dotted for f in FIELDS]


# ------------------------------------------------------------------------------------------ every field, fixed values


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_field_takes_each_kind_of_wrong_value_in_one_line_or_as_a_valid_config(f):
    """Every field gets every CLASSIC value, its bounds and enum near misses, by dict and by --set (fixed: no
    hypothesis, so that each kind of wrong value reaches each field on every run)."""
    by_dict, by_set = (0, 1) if f.in_pool else (None, None)  # a pool's field: the first pool by dict, the second by --set
    for value in field_values(f):
        check(build_config, as_dict(f.path, value, by_dict), where=(f, by_dict, value))
        check(load_config, None, [f"{as_override(f, by_set, True)}={as_yaml(value)}"], where=(f, by_set, value))


# ------------------------------------------------------------------------------------------ every field, generated values


def _fuzz_field(f: ConfigField, data: st.DataObject) -> None:
    pool = data.draw(st.sampled_from((0, 1)), label="pool") if f.in_pool else None
    value = data.draw(values_for(f), label="value")
    check(build_config, as_dict(f.path, value, pool), where=(f, pool, value))
    key = as_override(f, pool, data.draw(st.booleans(), label="by name"))
    check(load_config, None, [f"{key}={as_yaml(value)}"], where=(f, pool, value))
    raw = data.draw(st.text(max_size=16), label="raw VALUE")  # not YAML at all, often: its parse errors are bad input too
    check(load_config, None, [f"{key}={raw}"])


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
@FAST
@given(data=st.data())
def test_every_field_takes_generated_values_in_one_line_or_accepts_them(f, data):
    _fuzz_field(f, data)


@pytest.mark.extended
@EXTENDED
@given(data=st.data())
def test_extended_generated_values_for_any_field(data):
    _fuzz_field(data.draw(st.sampled_from(FIELDS), label="field"), data)


# ------------------------------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize("path, model", SECTIONS, ids=[".".join(p) or "config" for p, _ in SECTIONS])
@FAST
@given(data=st.data())
def test_an_unknown_key_in_any_section_is_named_in_one_line(path, model, data):
    pool = data.draw(st.sampled_from((0, 1)), label="pool")
    prefix = "".join(f"{pool if p == '*' else p}." for p in path)  # a pool's key as the message has it: by index
    key = data.draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in model.model_fields), label="key")
    with pytest.raises(ConfigError) as err:
        build_config(as_dict((*path, key), 1, pool))
    one_line(str(err.value))
    assert str(err.value).startswith(f"unknown config field '{prefix}{printable(key)}'"), str(err.value)
    word = data.draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(
        lambda k: k not in model.model_fields), label="--set key")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{prefix}{word}=1"])
    one_line(str(err.value))
    assert str(err.value).startswith(f"unknown config field '{prefix}{word}'"), str(err.value)


# ------------------------------------------------------------------------------------------ several fields at once


@settings(FAST, max_examples=40)
@given(data=st.data())
def test_several_wrong_fields_at_once_still_give_one_line(data):
    chosen = data.draw(st.lists(st.sampled_from(FIELDS), min_size=2, max_size=5, unique_by=lambda f: f.dotted))
    merged: dict[str, Any] = {}
    overrides = []
    for f in chosen:
        pool = data.draw(st.sampled_from((0, 1))) if f.in_pool else None
        value = data.draw(values_for(f))
        put(merged, f.path, value, pool)
        overrides.append(f"{as_override(f, pool, data.draw(st.booleans()))}={as_yaml(value)}")
    check(build_config, merged)
    check(load_config, None, overrides)


# ------------------------------------------------------------------------------------------ what the fuzzing found

GOT_BOOLEAN = "(YAML reads true, yes and on as a boolean); write the number itself"
NOT_YAML = "close its brackets and quotes, or quote it whole as a string"

# Each bug the fuzzing found, fixed: (what it was before the fix, the input, the one line it gives now).
FOUND = [
    ("TypeError: unhashable type: 'list'", {"mode": ["sync-diloco"]},
     "config field 'mode': Input should be 'decoupled', 'sync-diloco' or 'streaming-diloco'"),
    ("TypeError: 'int' object is not iterable", {"mode": "sync-diloco", "outer": 5},
     "config field 'outer': Input should be a valid dictionary or instance of OuterSection"),
    ("'dictionary update sequence element #0 has length 1; 2 is required', no field", {"mode": "sync-diloco", "outer": "ab"},
     "config field 'outer': Input should be a valid dictionary or instance of OuterSection"),
    ("yaml ParserError, a traceback of five lines", ["outer.lr=[0.5"],
     f"--set 'outer.lr=[0.5': the value of outer.lr is not valid YAML (expected ',' or ']', but got '<stream end>'); "
     f"{NOT_YAML}: --set \"outer.lr='...'\""),
    ("yaml ReaderError", ["model.factory=\x07"],
     f"--set 'model.factory=\\x07': the value of model.factory is not valid YAML (unacceptable character #x0007: special "
     f"characters are not allowed); {NOT_YAML}: --set \"model.factory='...'\""),
    ("ValueError: invalid literal for int() with base 10: '²'", ["pools.².islands=3"],
     "--set 'pools.².islands=3': pools has no entry named '²'; use one of fast, slow or an index 0..1"),
    ("'... so index 0 does not exist; use 0..-1'", ["pools=[]", "pools.0.islands=2"],
     "--set 'pools.0.islands=2': pools is empty, so it has no entry '0'; set the whole list instead, e.g. --set 'pools=[...]'"),
    ("accepted as 1 fragment", ["outer.num_fragments=yes"],
     f"config field 'outer.num_fragments': Input should be a number, got True {GOT_BOOLEAN}"),
    ("accepted as K = 1", ["outer.min_quorum=true"],
     f"config field 'outer.min_quorum': Input should be a number, got True {GOT_BOOLEAN}"),
    ("accepted as 1.0", ["pools.0.resources={pool_a: true}"],
     f"config field 'pools.0.resources': Input should be a number, got a boolean in {{'pool_a': True}} {GOT_BOOLEAN}"),
    ("accepted, past what numpy and torch take", ["run.token_budget=100000000000000000000"],
     "config field 'run.token_budget': Input should be less than 2**63 in size (a 64-bit integer), got "
     "100000000000000000000; write a smaller number"),
    ("accepted; numpy's data order then refuses it, and diloco train blamed the corpus ('cuts into 1759 training "
     "unit(s), too few for 4 islands')", ["run.seed=-1"],
     "config field 'run.seed': Input should be greater than or equal to 0"),
    ("accepted; Ray refuses it at the island's start", ["pools.slow.resources={pool_a: -1}"],
     "config field 'pools.1.resources.pool_a': Input should be greater than 0"),
    ("accepted", ["pools.fast.cpus_per_island=.inf"], "config field 'pools.0.cpus_per_island': Input should be a finite number"),
    ("accepted", ["outer.tau_steps=.inf"], "config field 'outer.tau_steps': Input should be a finite number"),
    ("'Input should be greater than 0' for NaN", ["run.placement_timeout_s=.nan"],
     "config field 'run.placement_timeout_s': Input should be a finite number"),
    ("two lines", {"outer": {"min_quorm\n": 2}},
     "unknown config field 'outer.min_quorm\\n'; remove it or check the spelling: did you mean 'outer.min_quorum'? (see "
     "configs/default.yaml)"),
    ("two lines", {"pools": [{"name": "a\nb", "data_path": "/copy"}]},
     "pools.a\\nb.data_path='/copy' has no effect: copies are for parquet or token-file corpora, and data.source is "
     "'stdlib'; drop data_path from pools.a\\nb"),
    ("two lines", {"data": {"tokenizer": "my\ntok", "tokenizer_sample_bytes": 1000}},
     "data.tokenizer_sample_bytes=1000 has no effect: only data.tokenizer=train reads a sample, and it is 'my\\ntok'; "
     "set data.tokenizer=train, or drop data.tokenizer_sample_bytes"),
    ("two lines", {"pools": [{"name": "a", "islands": {"min": "2\n", "max": 3}}]},
     "config field 'pools.0': pool 'a': islands {min: '2\\n', max: 3} needs whole numbers 0 <= min <= max, max >= 1; "
     "e.g. islands: {min: 2, max: 6}"),
]


@pytest.mark.parametrize("was, given, now", FOUND, ids=[f"{i}" for i in range(len(FOUND))])
def test_each_bug_the_fuzzing_found_gives_its_one_line(was, given, now):
    with pytest.raises(ConfigError) as err:
        build_config(given) if isinstance(given, dict) else load_config(None, given)
    assert str(err.value) == now, f"was: {was}"
    one_line(now)


def test_what_the_fuzzing_leaves_valid_still_loads():
    # inf where a field says it takes it; a number written as a string (YAML's "3"); a true/false field's yes.
    cfg = load_config(None, ["outer.grace_gamma=.inf", "outer.grace_cap_s=.inf", "pools.0.islands='3'", "run.final_flush=no",
                             "pools.0.resources={pool_a: 1}", "run.seed=9223372036854775807"])
    assert math.isinf(cfg.outer.grace_gamma) and cfg.pools[0].islands == 3 and cfg.run.final_flush is False
    assert math.isinf(load_config(None, ["mode=sync-diloco"]).outer.grace_cap_s)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"run:\n  seed: \xff\n")  # was: UnicodeDecodeError, a ValueError naming no file
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config file {str(path)!r} is not UTF-8 text (byte 13 is 0xff); save it as UTF-8"


# ------------------------------------------------------------------------------------------ the real command


NO_RAY_CLI = """
import runpy, sys
sys.modules["ray"] = None  # any import of Ray fails loudly: a refusal with exit code 2 came before Ray
sys.argv[0] = "diloco"
runpy.run_module("orchestrator.cli", run_name="__main__")
"""


def test_diloco_train_refuses_bad_values_in_one_line_exit_2_without_ray(tmp_path):
    cases = ["outer.lr=[0.5", "mode=[sync-diloco]", "pools.slow.resources={pool_a: true}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "127.0.0.1:9", "RAY_TMPDIR": str(tmp_path / "ray")}
    runs = [(item, tmp_path / f"run{i}", subprocess.Popen(
        [sys.executable, "-c", NO_RAY_CLI, "train", "--quiet", "--run-dir", str(tmp_path / f"run{i}"), "--set", item],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for i, item in enumerate(cases)]
    for item, run_dir, proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (item, err)
        assert "Traceback" not in err and out == "", (item, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("diloco train: "), (item, err)
        one_line(lines[0])
        assert not run_dir.exists()
    assert not (tmp_path / "ray").exists(), "nothing of Ray's was written"
