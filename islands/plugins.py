"""The merge rule and the compressor a config names: a registered name, or a user's plug-in by import path.

``outer.merge_rule`` and ``outer.compression`` take a name the registries hold (policies/merge_rules.py,
policies/compressor.py: the built-ins, and any a program registered) or an import path
``package.module:Name`` naming a class (or zero-argument factory) whose instance implements the interface. A
path is resolved as the model factory's is (islands.model_api.resolve_callable), the instance checked, and
registered under the path itself: the path is the name a config, a checkpoint and a wire tensor carry, and any
process that loads it again finds the same plug-in. What cannot be loaded is one :class:`ModelError` line (a
ValueError: the config's validators report it as a ConfigError before Ray starts).
"""

from __future__ import annotations

from typing import Any

import policies.compression  # noqa: F401 - importing it registers the built-in compressors
from islands.model_api import ModelError, first_line, resolve_callable
from policies.compressor import Compressor, compressor_registry
from policies.merge_rules import MergeRule, merge_rule_registry
from policies.plugin_registry import Registry

__all__ = ["load_compressor", "load_merge_rule"]


def load_merge_rule(spec: str) -> MergeRule:
    """The merge rule `spec` names (module docstring); a one-line ModelError if it does not load."""
    return _load(spec, merge_rule_registry(), "merge rule", "merge_into(out, column, weights)")


def load_compressor(spec: str) -> Compressor:
    """The compressor `spec` names (module docstring); a one-line ModelError if it does not load."""
    return _load(spec, compressor_registry(), "compressor", "encode(t, block_size=, density=) and decode(c)",
                 unknown="compression")


def _load(spec: str, registry: Registry[Any], kind: str, methods: str, unknown: str | None = None) -> Any:
    """`spec` from `registry`, or resolved, built, checked and registered there. `kind` names the plug-in in
    messages, `unknown` (default `kind`) in the one a name that is not registered gets (as the config calls it)."""
    if not isinstance(spec, str):
        raise ModelError(f"{kind} is a {type(spec).__name__}; give a registered name or an import path "
                         f"{registry.path_form}")
    spec = spec.strip()
    if spec in registry:
        return registry.get(spec)
    if ":" not in spec:
        try:
            registry.get(spec, kind=unknown or kind)  # raises the line that names what is registered
        except ValueError as err:
            raise ModelError(str(err)) from None
    make = resolve_callable(spec, kind)  # a path that does not import or resolve: its one line already
    assert make is not None
    interface = registry.interface
    missing = sorted(getattr(make, "__abstractmethods__", ()))
    if isinstance(make, type) and issubclass(make, interface) and missing:
        raise ModelError(f"{kind} {spec!r} does not define {', '.join(missing)}; a {interface.__qualname__} "
                         f"defines {methods}")
    try:
        made = make()
    except Exception as err:  # noqa: BLE001 - the user's constructor failed: one line, the traceback chained
        raise ModelError(f"{kind} {spec!r} raised {type(err).__name__} when built with no arguments: "
                         f"{first_line(err)}; give it a constructor that takes none") from err
    if not isinstance(made, interface):
        raise ModelError(f"{kind} {spec!r} built a {type(made).__name__}, not a {interface.__module__}."
                         f"{interface.__qualname__}; subclass it and define {methods}")
    return registry.register(spec, made)
