"""Nothing in policies/ imports Ray: import every module with Ray blocked, in a fresh interpreter."""

import pathlib
import subprocess
import sys

POLICIES = pathlib.Path(__file__).resolve().parents[2] / "policies"
MODULES = sorted(p.stem for p in POLICIES.glob("*.py") if p.stem != "__init__")


def test_policies_import_without_ray():
    assert "quorum" in MODULES and "merge" in MODULES  # the glob found the package
    code = "\n".join(
        [
            "import importlib, sys",
            "sys.modules['ray'] = None  # any 'import ray' now raises ImportError",
            "importlib.import_module('policies')",
            *[f"importlib.import_module('policies.{name}')" for name in MODULES],
            "assert not any(m == 'ray' or m.startswith('ray.') for m, v in sys.modules.items() if v is not None)",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=POLICIES.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_block_really_blocks():
    # Guard against a vacuous pass: the same trick makes a Ray import fail.
    code = "import sys\nsys.modules['ray'] = None\nimport ray"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "import of ray halted" in result.stderr
