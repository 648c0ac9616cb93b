"""The public API (`orchestrator`'s names) holds everything notebook 05 needs, and docs/api.md names it (no Ray).

Notebook 05 (a Hugging Face Llama, a tokenizer trained on Parquet text, Ray Data) is the walkthrough a new
user copies from: it imports nothing private, sets no Ray Data internals by hand, and every public name is
documented. tests/notebooks/test_notebooks.py runs it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator
from orchestrator.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "05-bring-your-own-model.ipynb"
OURS = ("orchestrator", "islands", "policies")


def notebook_code() -> str:
    """The notebook's code cells as one Python source (IPython magics left out)."""
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    lines = [line for c in cells for line in "".join(c["source"]).splitlines() if not line.lstrip().startswith("%")]
    return "\n".join(lines)


def test_every_public_name_resolves_and_importing_the_package_loads_neither_torch_nor_ray():
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None, name
    assert set(orchestrator.__all__) <= set(dir(orchestrator))
    with pytest.raises(AttributeError, match="has no attribute 'ensure_ray'"):
        orchestrator.ensure_ray  # noqa: B018 - the access is the test
    probe = "import sys, orchestrator; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_notebook_05_uses_the_public_api_only():
    """The bug: it imported islands.tokenizer.train_tokenizer, orchestrator.run.driver.ensure_ray and
    orchestrator.actors.remote.ignore_zero_copy_warnings, and set DataContext.use_datasource_v2 by hand."""
    tree = ast.parse(notebook_code())
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.split(".")[0] in OURS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OURS:
            if node.module != "orchestrator":
                private.append(node.module)
            private += [f"orchestrator.{a.name}" for a in node.names
                        if node.module == "orchestrator" and a.name not in orchestrator.__all__]
    assert private == [], f"notebook 05 imports names outside the public API: {private}"
    assert "use_datasource_v2" not in notebook_code(), "the engine's init_ray sets Ray Data's reader"


def test_docs_api_md_names_every_public_name():
    text = (REPO / "docs" / "api.md").read_text()
    missing = [name for name in orchestrator.__all__ if f"`{name}" not in text]
    assert missing == [], f"docs/api.md does not document {missing}"


def test_init_ray_starts_ray_as_fit_would_and_picks_ray_datas_classic_parquet_reader(monkeypatch):
    import ray.data

    calls = []
    monkeypatch.setattr("orchestrator.run.driver.ensure_ray", lambda cfg, address: calls.append((cfg, address)) or True)
    context = ray.data.DataContext.get_current()
    saved, context.use_datasource_v2 = context.use_datasource_v2, True
    try:
        cfg = load_config(None, ["health.warm_spares=0"])
        assert orchestrator.init_ray(cfg, address="auto") is True
        assert calls == [(cfg, "auto")] and context.use_datasource_v2 is False
        context.use_datasource_v2 = True
        orchestrator.init_ray(ray_data_v2=True)
        assert context.use_datasource_v2 is True and calls[-1][1] is None
        assert isinstance(calls[-1][0], orchestrator.RunConfig)
    finally:
        context.use_datasource_v2 = saved
    with pytest.raises(ConfigError, match="run_config is a dict; pass an orchestrator.RunConfig"):
        orchestrator.init_ray({"run": {}})


def test_a_tokenizer_trains_and_round_trips_through_the_public_names(tmp_path):
    pytest.importorskip("tokenizers")
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x):\n        self.x = x\n"] * 20
    encoder = orchestrator.text_encoder(orchestrator.train_tokenizer(texts, 300))
    assert isinstance(encoder, orchestrator.TextEncoder) and 257 < encoder.vocab_size <= 300
    line = "    def __init__(self, name):"
    assert encoder.decode(encoder.encode(line)) == line and len(encoder.encode(line)) < len(line)
    encoder.save(tmp_path / "tokenizer.json")
    assert orchestrator.text_encoder(tmp_path / "tokenizer.json").encode(line) == encoder.encode(line)
