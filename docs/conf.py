"""Sphinx configuration of cuep's user guide: Markdown pages (MyST) and an API reference from the docstrings
(autodoc, napoleon). Built with warnings as errors by tests/test_docs.py:

    python -m sphinx -W -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cuep  # noqa: E402  (the version below is the package's own)

project = "cuep"
author = "the cuep developers"
copyright = "the cuep developers; Apache-2.0"
release = version = cuep.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_heading_anchors = 3


# The API reference documents what a user imports; the docstrings are written in the Google style that
# napoleon reads ("Arguments:", "Returns:", "Raises:").
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# torch, CuPy and NVSHMEM are not needed to read the docstrings: the modules that import them import lazily.
autodoc_mock_imports: list[str] = []

html_theme = "alabaster"
html_title = f"cuep {version}"
# The docstrings' "Returns:" name each item of a returned tuple, like "Arguments:" names the arguments;
# "Requirements:" says what must hold before a call.
napoleon_custom_sections = [("Returns", "params_style"), ("Requirements", "Notes")]
