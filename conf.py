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
    "sphinx_gallery.gen_gallery",  # runs examples/plot_*.py and renders them as pages
    "gallery_support",  # strips third-party assets from the execution-times pages
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
html_favicon = (
    "docs/_static/favicon.svg"  # a missing favicon is a failed request in the browser
)
html_show_sourcelink = (
    False  # readers want the example downloads, not the generated reST
)
pygments_style = "a11y-light"  # WCAG AA contrast for code
pygments_dark_style = "a11y-dark"

# Build one example while writing it: make html EXAMPLE=plot_per_sample_grads
_only_example = os.environ.get("GALLERY_EXAMPLE", "").removesuffix(".py")

sphinx_gallery_conf = {
    "examples_dirs": "../examples",  # relative to docs/, the source folder
    "gallery_dirs": "auto_examples",  # generated, git-ignored
    "filename_pattern": re.escape(os.sep + _only_example)
    if _only_example
    else re.escape(os.sep) + "plot_",
    "within_subsection_order": "gallery_support.ReadingOrder",  # the index page's order
    "download_all_examples": True,  # zips of every .py and every .ipynb
    "first_notebook_cell": gallery_support.notebook_install_cell(),  # installs torch where missing
    "reset_modules": (
        "matplotlib",
        "gallery_support.reset_state",
    ),  # no state leaks between examples
    "reset_modules_order": "before",
    "abort_on_example_error": False,  # run every example, then fail the build listing all failures
    "only_warn_on_example_error": False,
    "min_reported_time": 0,  # every page shows its running time
    "write_computation_times": True,  # keep the execution-times table
    "show_memory": gallery_support.memory_reporter(),  # CUDA peak memory on GPU builds
    "remove_config_comments": True,
    "image_srcset": ["2x"],  # sharp figures on high-density screens
    "thumbnail_size": (400, 280),
}
