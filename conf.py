"""Sphinx configuration for torch.func by example. Logic lives in docs/gallery_support.py."""

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "docs"))  # so gallery_support imports
import gallery_support  # noqa: E402

project = "torch.func by example"
html_title = "torch.func by example"  # the site says what it is in every tab and header
author = "The torch.func by example authors"
copyright = "2026, " + author
root_doc = "index"

extensions = [
    # Runs examples/plot_*.py and renders them as pages.
    "sphinx_gallery.gen_gallery",
    # Example buttons, thumbnail alt text, PyTorch API links, no third-party assets.
    "gallery_support",
]
exclude_patterns = [
    "auto_examples/*.ipynb",
    "auto_examples/*.py",
    "auto_examples/*.zip",
]

# "Run in Google Colab" opens the notebook from the branch that GitHub Pages serves. The
# repository (owner/name) comes from GitHub Actions; where it is empty the button is left out.
colab_notebooks = {
    "repository": os.environ.get("GITHUB_REPOSITORY", ""),
    "branch": "gh-pages",
}

html_theme = "furo"
html_static_path = ["docs/_static"]  # relative to conf.py
html_css_files = ["site.css"]
# A missing favicon is a failed request in the browser.
html_favicon = "docs/_static/favicon.svg"
# Readers want the example downloads, not the generated reST.
html_show_sourcelink = False
pygments_style = "a11y-light"  # WCAG AA contrast for code, in both themes
pygments_dark_style = "a11y-dark"

# Build one example while writing it: make html EXAMPLE=plot_per_sample_grads
_only_example = os.environ.get("GALLERY_EXAMPLE", "").removesuffix(".py")
_run_pattern = re.escape(os.sep + (_only_example or "plot_"))

sphinx_gallery_conf = {
    # Relative to docs/, the source folder; the gallery is generated and git-ignored.
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": _run_pattern,
    # The gallery follows the reading order of the index page.
    "within_subsection_order": "gallery_support.ReadingOrder",
    # Zips of every .py and every .ipynb.
    "download_all_examples": True,
    # Notebooks open with a cell that installs torch and matplotlib where they are missing.
    "first_notebook_cell": gallery_support.notebook_install_cell(),
    # Seeds, torch's global settings and matplotlib are reset before every example.
    "reset_modules": ("matplotlib", "gallery_support.reset_state"),
    "reset_modules_order": "before",
    # Run every example, then fail the build and list every failure.
    "abort_on_example_error": False,
    "only_warn_on_example_error": False,
    # Every page shows its running time; the execution-times table is kept.
    "min_reported_time": 0,
    "write_computation_times": True,
    # CUDA peak memory on GPU builds, nothing on the CPU.
    "show_memory": gallery_support.memory_reporter(),
    "remove_config_comments": True,
    # Sharp figures on high-density screens.
    "image_srcset": ["2x"],
    "thumbnail_size": (400, 280),
}
