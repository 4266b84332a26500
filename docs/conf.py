"""Sphinx configuration of pnpscale's documentation (Markdown pages through myst-parser).

Build it strict, as the tests do::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib.util

project = "pnpscale"
author = "the pnpscale developers"
copyright = "the pnpscale developers"
release = "0.1.0"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: `[text](page.md#a-heading)` links to headings up to level 3; `$...$` is not math here
# (the pages quote formulas as code).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# furo when it is installed (the `docs` extra), else Sphinx's built-in theme.
html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = "pnpscale"
html_static_path: list[str] = []
