"""Sphinx configuration: `make docs` builds the site into docs/_build/html, warnings as errors."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

import fedjax_pan  # noqa: E402

project = "fedjax_pan"
author = "fedjax_pan contributors"
copyright = "2026, fedjax_pan contributors"
release = fedjax_pan.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "plain_docstrings",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
root_doc = "index"

# MyST: GitHub-style Markdown plus math; headings get anchors so pages link to sections.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks (MyST text sources under notebooks/) run on every build; a failing cell fails it.
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# API reference: docstrings read by autodoc, signatures with their type hints.
autosummary_generate = True
templates_path = ["_templates"]
# Each object is documented where it is defined, not again where a package re-exports it.
autodoc_default_options = {"members": True, "ignore-module-all": True}
autodoc_typehints = "description"
autodoc_member_order = "bysource"

# Short names a docstring mentions (`score`) may belong to several classes; the reference
# then links the first, which is not an error in the page.
suppress_warnings = ["ref.python"]

html_theme = "sphinx_book_theme"
html_title = f"fedjax_pan {release}"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
}
html_static_path = []
