"""The headless notebook commands of README.md and docs/notebooks.md, run as written on a throwaway notebook.

Each `jupyter ...` command the two documents give (not `jupyter lab`, which opens a browser) runs in a
scratch folder laid out like the repository, its notebook path pointed at a one-cell notebook there, with a
real `python3` kernel and no Ray. The notebook it names must be left as it was (an earlier `jupyter execute
--output NAME.out` overwrote it: nbclient swaps the name's suffix for .ipynb), and its output must appear
where the command says: on stdout, or under `--output-dir`. The commands need the `dev` extra only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbconvert", reason="the dev extra installs nbconvert")
import nbformat  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = re.compile(r"notebooks/\d\d-[\w-]+\.ipynb")
MARK = "the throwaway notebook ran"


def documented_commands() -> list[str]:
    """The `jupyter` commands of docs/notebooks.md's bash blocks and of the README's Notebooks section."""
    commands = []
    doc = (REPO / "docs" / "notebooks.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", doc, re.S):
        commands += [line.strip() for line in block.splitlines()
                     if re.match(r"(DILOCO_NOTEBOOK_SMALL=1 )?jupyter ", line.strip())]
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Notebooks\n", 1)[1].split("\n## ", 1)[0]
    commands += re.findall(r"`((?:DILOCO_NOTEBOOK_SMALL=1 )?jupyter (?!lab)[^`]+\.ipynb)`", section)
    return [c for c in commands if not c.split("jupyter ", 1)[1].startswith("lab")]


COMMANDS = documented_commands()


def test_the_docs_give_headless_commands_for_real_notebooks():
    assert len(COMMANDS) >= 3, COMMANDS
    dev = re.search(r"^dev = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert '"nbconvert' in dev, "the dev extra must install nbconvert: the documented commands use it"
    for command in COMMANDS:
        (named,) = NOTEBOOK.findall(command)
        assert (REPO / named).is_file(), f"{command!r} names {named}, which is not in the repository"


@pytest.mark.notebook
@pytest.mark.parametrize("command", COMMANDS)
def test_a_documented_notebook_command_runs_and_leaves_the_notebook_as_it_was(command, tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook = folder / "00-throwaway.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f"print({MARK!r})")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, notebook)
    before = notebook.read_bytes()
    # The console scripts (jupyter, jupyter-nbconvert) sit beside this interpreter, in or out of a virtualenv.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", "-c", NOTEBOOK.sub("notebooks/00-throwaway.ipynb", command)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command!r} failed:\n{done.stderr[-2000:]}"
    assert notebook.read_bytes() == before, f"{command!r} overwrote the notebook it ran"
    assert sorted(p.name for p in folder.iterdir()) == [notebook.name], f"{command!r} wrote beside the notebook"
    if "--stdout" in command:
        assert MARK in done.stdout, done.stdout
        return
    out_dir = re.search(r"--output-dir (\S+)", command)
    assert out_dir, f"where does {command!r} write? teach this test"
    written = tmp_path / out_dir.group(1) / notebook.name
    outputs = [o for c in nbformat.read(written, as_version=4).cells for o in c.get("outputs", [])]
    assert any(MARK in o.get("text", "") for o in outputs), outputs
