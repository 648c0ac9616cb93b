"""docs/config.md stays the config's reference: every field has a row in its tables,
and every description in orchestrator/config.py is reference text (short; experiments say so)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from orchestrator.config import PoolConfig, RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    """(dotted name, FieldInfo) of every field, sections included, pools as `pools[].name`."""
    out = []
    for name, info in model.model_fields.items():
        out.append((prefix + name, info))
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _fields(ann, f"{prefix}{name}.")
    return out


ALL = _fields(RunConfig) + [(f"pools[].{n}", i) for n, i in PoolConfig.model_fields.items()]


def _rows() -> dict[str, str]:
    """Each table row of docs/config.md by the field named in its first cell (as written: `name`)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_0-9]+)` \|", line)
        if m:
            rows.setdefault(m.group(1), line)
    return rows


@pytest.mark.parametrize("name,info", ALL, ids=[n for n, _ in ALL])
def test_every_field_has_a_row_in_docs_config(name, info):
    leaf = name.rsplit(".", 1)[-1]
    assert leaf in _rows(), f"docs/config.md has no table row for {name}; add one (type, default, meaning)"


@pytest.mark.parametrize("name,info", ALL, ids=[n for n, _ in ALL])
def test_every_description_is_a_line_or_two(name, info):
    text = info.description or ""
    assert text, f"{name} has no description"
    assert len(text) <= 200, f"{name}'s description is {len(text)} characters; reasoning belongs in docs/config.md"


def test_experimental_fields_say_so_in_the_docs_too():
    rows = _rows()
    experimental = [n for n, i in ALL if (i.description or "").startswith("Experimental:")]
    assert experimental, "the config marks no field experimental; docs/config.md says some are"
    for name in experimental:
        assert "Experimental:" in rows[name.rsplit(".", 1)[-1]], f"docs/config.md's row for {name} drops 'Experimental:'"
