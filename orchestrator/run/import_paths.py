"""How a run directory names the callables it was given, so that another process can import them again.

config.yaml records the model factory, the loss and the optimizer factory as import paths
``module:qualname`` (orchestrator/run/workload.py, ``recorded_config``); ``diloco sample``,
``evaluate``, ``export`` and ``train --resume`` rebuild the model from them in a new process. Whatever
form the public API was given:

- an import path string: recorded as it is;
- a function or class of an importable module: ``module:qualname``;
- a function of a script run as ``python train.py`` (module ``__main__``): named by the script's own
  module, ``train:make_model`` (its path from the working directory, dotted, else its file name), when
  the script keeps its work under ``if __name__ == "__main__":``. Importing it then defines the function
  without running that block, as multiprocessing's spawn start method imports a main module; the
  commands import it from the working directory, as ``diloco train --model`` does. ``python -m
  pkg.train`` is named ``pkg.train`` under the same rule;
- a function of a notebook, of a script without that block or of the REPL: ``__main__:qualname``,
  which only its own process can import; the commands that would rebuild it say in one line what to
  pass instead (``--model``, or ``Result.load_model(model=...)``);
- a callable object (an instance with ``__call__``, ``functools.partial``): nothing, since no import path
  rebuilds its arguments; the same one-line message applies.

No torch and no Ray at import.
"""

from __future__ import annotations

import ast
import keyword
import sys
from pathlib import Path
from typing import Any

__all__ = ["MAIN", "import_path_of", "is_main_path", "main_module_name"]

MAIN = "__main__"
"""The module name of a notebook's or a script's own code, which no other process can import."""


def import_path_of(obj: Any) -> str | None:
    """The import path config.yaml records for `obj` (a model factory, a loss, an optimizer factory), or None.

    None for None and for a callable object that no import path rebuilds; the module docstring has the rules.
    """
    if obj is None:
        return None
    if isinstance(obj, str):
        return obj.strip() or None
    if type(obj).__name__ == "ModelFactory":
        from islands.model_api import ModelFactory  # torch: only for a factory, which is torch's business anyway

        if isinstance(obj, ModelFactory):  # the path it was resolved from, else its callable's
            return obj.spec or import_path_of(obj.target)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None  # an instance: its class's path would rebuild the class, not this object
    if module == MAIN:
        module = main_module_name() or MAIN
    return f"{module}:{qualname}"


def is_main_path(path: str | None) -> bool:
    """True for an import path into ``__main__`` (a notebook's or an unguarded script's function)."""
    return bool(path) and str(path).strip().partition(":")[0] == MAIN


def main_module_name(main: Any = None, cwd: Path | None = None) -> str | None:
    """The module another process imports this process's ``__main__`` as, or None where none can.

    `main`: the main module (default ``sys.modules["__main__"]``); `cwd`: the working directory (default now).
    A module name needs a script file with an ``if __name__ == "__main__":`` block at its top level.
    """
    main = sys.modules.get(MAIN) if main is None else main
    spec = getattr(main, "__spec__", None)
    file = getattr(main, "__file__", None)
    if spec is not None and getattr(spec, "name", MAIN) not in (MAIN, None):  # python -m pkg.train (or pkg.__main__)
        name = spec.name
        return name if file and has_main_guard(Path(file)) and not _shadowed(name, Path(file)) else None
    if not isinstance(file, str) or not file.endswith(".py"):
        return None  # a notebook, the REPL, python -c
    path = Path(file).resolve()
    if not has_main_guard(path):
        return None
    name = _module_name(path, (cwd or Path.cwd()).resolve())
    return None if name is None or _shadowed(name, path) else name


def has_main_guard(path: Path) -> bool:
    """True when the Python file `path` has ``if __name__ == "__main__":`` at its top level."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    return any(isinstance(node, ast.If) and _is_main_test(node.test) for node in tree.body)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == MAIN for s in sides))


def _module_name(path: Path, cwd: Path) -> str | None:
    """The dotted module of `path` from `cwd` when it lies under it (scripts/train.py -> scripts.train), else
    its file name's (imported from its own directory); None when a part is no identifier."""
    parts = list(path.relative_to(cwd).with_suffix("").parts) if path.is_relative_to(cwd) else [path.stem]
    ok = all(p.isidentifier() and not keyword.iskeyword(p) for p in parts)
    return ".".join(parts) if ok and parts else None


def _shadowed(name: str, path: Path) -> bool:
    """True when importing `name` would find another module first: a standard-library or built-in name (code.py,
    test.py), or a module already imported from elsewhere."""
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    loaded = getattr(sys.modules.get(name), "__file__", None)
    return loaded is not None and Path(loaded).resolve() != path.resolve()
