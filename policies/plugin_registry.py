"""Plug-ins by name: the registry behind merge rules (policies/merge_rules.py) and compressors (policies/compressor.py).

One process-wide table per kind. The built-ins register themselves when their module is imported; a user's
plug-in named by an import path is resolved by islands/plugins.py and registered under that path, so the
string a config or a wire tensor carries finds the same object in every process that resolved it.

Pure (no torch).
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one interface by name.

    Args:
        kind: how messages name an entry ("merge rule", "compressor").
        interface: the class every entry is an instance of.
        path_form: how a user's entry is named, for the message an unknown name gets.
    """

    def __init__(self, kind: str, interface: type, path_form: str) -> None:
        self.kind, self.interface, self.path_form = kind, interface, path_form
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add `entry` under `name` and return it; a one-line ValueError for a wrong type or a name taken by another."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} is registered under a non-empty name, got {name!r}")
        if not isinstance(entry, self.interface):
            raise ValueError(f"{self.kind} {name!r} is a {type(entry).__name__}, not a {self.interface.__module__}."
                             f"{self.interface.__qualname__}; subclass it")
        held = self._entries.get(name)
        if held is not None and held is not entry:
            raise ValueError(f"{self.kind} {name!r} is already registered (a {type(held).__name__}); pick another name")
        self._entries[name] = entry
        return entry

    def get(self, name: str, *, kind: str | None = None) -> T:
        """The entry `name`; a one-line ValueError naming what exists and how to name a plug-in if there is none
        (`kind` names the entry there instead, as the config calls it)."""
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            named = [n for n in self._entries if ":" not in n]  # the loaded plug-ins' import paths go unlisted
            raise ValueError(f"unknown {kind or self.kind} {name!r}; use one of {', '.join(named)} or an import path "
                             f"{self.path_form}")
        return entry

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def names(self) -> tuple[str, ...]:
        """Registered names, in order of registration."""
        return tuple(self._entries)
