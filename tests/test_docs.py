"""The user guide builds with no warnings (Sphinx, MyST, autodoc: see docs/README.md), and every command the
README shows names a script or module that exists."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["index", "getting-started", "cupy-api", "from-deepep", "low-latency", "internode", "troubleshooting",
         "performance", "environment", "changelog", "api", "performance-log"]


def test_the_user_guide_builds_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="the docs build needs sphinx and myst-parser (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                             str(ROOT / "docs"), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    for page in PAGES:
        assert (tmp_path / f"{page}.html").is_file(), page
    api = (tmp_path / "api.html").read_text()
    for documented in ("cuep.Buffer.dispatch", "cuep.Buffer.low_latency_dispatch", "cuep.torch.Buffer.dispatch",
                       "cuep.errors.CallOrderError", "cuep.errors.NoGPUError"):
        assert f'id="{documented}"' in api, documented


def readme_commands() -> list[str]:
    """Every command line of the README's ``bash`` blocks (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.split(" #")[0].strip() for line in block.splitlines() if line.strip()
                  and not line.lstrip().startswith("#")]
    return lines


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 3


@pytest.mark.parametrize("command", readme_commands())
def test_each_readme_command_names_what_exists(command):
    """Each ``python -m <module>`` names a module that can be found, each ``<path>.py`` a file of the repo."""
    words = shlex.split(command.replace("$(", " ").replace(")", " "))
    for i, word in enumerate(words):
        if word == "-m" and i > 0 and re.fullmatch(r"python3?", words[i - 1]):
            module = words[i + 1]
            assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
        elif word.endswith(".py"):
            assert (ROOT / word).is_file(), f"{command}: no file {word}"
