"""What a new user copies: the install lines, the help's promise about the default run, where an export lands.

Text checks, no install: the README's Set up commands take torch's CPU build from PyTorch's CPU index (on PyPI,
`torch==X` is the CUDA build), at the version constraints-cpu.txt pins; `diloco --help` states the default run's
training time as the README measured it; the README's `diloco export ... --out model.pt` leaves no untracked file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_set_up_lines_install_torchs_cpu_build_from_pytorchs_cpu_index():
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints-cpu.txt").read_text(), re.M).group(1)
    setup = _section((ROOT / "README.md").read_text(), "Set up")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", setup, re.S) for line in block.splitlines() if line]
    assert len(lines) == 2, lines
    for line in lines:
        torch = next(step for step in line.split(" && ") if re.search(r"\btorch==", step))
        assert torch == f"pip install torch=={pin} {CPU_INDEX}", line
        assert "pip install -c constraints-cpu.txt -e " in line, "the project installs against the pinned torch"
    assert "CUDA build" in setup, "the Set up section says why"
    comment = "".join(line for line in (ROOT / "constraints-cpu.txt").read_text().splitlines(True) if line.startswith("#"))
    assert CPU_INDEX in comment and f"torch=={pin}" in comment


def test_diloco_help_states_the_default_runs_time_as_the_readme_measured_it():
    from orchestrator.cli import main

    readme = (ROOT / "README.md").read_text()
    wall = re.search(r"^wall time +(\d+) s$", readme, re.M).group(1)  # the default run's final table
    (line,) = [line for line in main.__doc__.splitlines() if line.strip().startswith("diloco train ") and "the default:" in line]
    assert f"{wall} s of training" in line, line
    assert "minute" not in line


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_readmes_export_file_is_ignored_by_git():
    readme = (ROOT / "README.md").read_text()
    out = re.search(r"diloco export \S+ --out (\S+)", readme).group(1)
    assert subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT).returncode == 0, f"{out} would be left untracked"
