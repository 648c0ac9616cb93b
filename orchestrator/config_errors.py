"""One line for a pydantic ValidationError of the run config: the field as the user writes it, and the fix.

Pydantic's own locations carry its internals: a union field's errors come one per member, each located
under a tag (`outer.min_quorum.int`, `outer.min_quorum.literal['all']`), and an unknown key says only
"Extra inputs are not permitted". Here the location is walked through the config's own fields, so tags
drop out and a union's members read as one list of what the field takes; an unknown key gets the
nearest field names of its section (difflib), at any depth, pools included.
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

SPELLING_HINT = "see configs/default.yaml"


def printable(text: str) -> str:
    """`text` with its unprintable characters (a newline, a tab, a bell) escaped, so that a user's key or name
    shown in a message keeps it one line: 'a\\nb' for 'a', newline, 'b'."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def field_path(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], bool, type[BaseModel] | None]:
    """(the field's dotted parts, whether a union member's tag was dropped, the model holding the last part).

    `loc` is pydantic's: field names, list indices, and after a union field the tag of the member that failed.
    """
    parts: list[str] = []
    annotation: Any = root
    holder: type[BaseModel] | None = None
    tagged = False
    for item in loc:
        model = _model(annotation)
        if model is not None:
            holder = model
            parts.append(str(item))
            annotation = model.model_fields[item].annotation if item in model.model_fields else None
            continue
        origin = get_origin(annotation)
        if origin in (Union, types.UnionType) and isinstance(item, str):
            tagged = True  # a union member's tag, e.g. "int" or "literal['all']": not a part of the field's name
            members = [a for a in get_args(annotation) if a is not type(None)]
            annotation = next((m for m in members if _model(m) is not None), None)
            continue
        parts.append(str(item))
        annotation = get_args(annotation)[0] if origin is list and isinstance(item, int) and get_args(annotation) else None
    return parts, tagged, holder


def _what_it_takes(messages: list[str]) -> str:
    """'Input should be a valid integer, unable to ...' and "Input should be 'all'" -> "a valid integer or 'all'"."""
    wants = []
    for m in messages:
        want = m.removeprefix("Input should be ").split(", unable to")[0].split(", got ")[0]
        if want not in wants:
            wants.append(want)
    return " or ".join(wants)


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> str:
    """The first error of `err` (raised validating `root`) in one line naming the field and the fix."""
    errors = err.errors()
    first = errors[0]
    parts, tagged, holder = field_path(root, tuple(first["loc"]))
    where = printable(".".join(parts)) or "config"
    if first["type"] == "extra_forbidden":
        known = list(holder.model_fields) if holder is not None else []
        close = difflib.get_close_matches(parts[-1], known, n=1, cutoff=0.6)
        near = "".join(f"'{printable('.'.join([*parts[:-1], c]))}'" for c in close)
        return (f"unknown config field '{where}'; remove it or check the spelling"
                + (f": did you mean {near}?" if near else "") + f" ({SPELLING_HINT})")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ValueError) and first["type"] == "value_error" and not parts:
        return str(cause)  # a whole-config rule whose message names its fields itself
    if tagged:
        # Every member of the union failed: say what the field takes, once, and what it was given.
        same = [e for e in errors if field_path(root, tuple(e["loc"]))[0] == parts]
        custom = [e for e in same if e["type"] == "value_error"]
        if custom:  # a member's own validator spoke (it names the rule): its words win
            return f"config field '{where}': {custom[0]['msg'].removeprefix('Value error, ')}"
        return f"config field '{where}': Input should be {_what_it_takes([e['msg'] for e in same])}, got {first['input']!r}"
    return f"config field '{where}': {first['msg'].removeprefix('Value error, ')}"
