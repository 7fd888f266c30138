"""Sphinx configuration for torch.func by example.

Only settings that differ from the defaults. The logic lives in docs/sphinxext/, one job per
module; its README lists them.
"""

import os
import sys
from pathlib import Path

# The site's extensions, one job per module.
sys.path.insert(0, str(Path(__file__).parent / "docs" / "sphinxext"))
from cuda_peak_memory import memory_reporter  # noqa: E402
from gallery_shards import filename_pattern  # noqa: E402
from notebook_install_cell import install_cell  # noqa: E402

project = "torch.func by example"
# The site says what it is in every tab and header.
html_title = project
author = "The torch.func by example authors"
copyright = "2026, " + author
root_doc = "index"

extensions = [
    "sphinx.ext.intersphinx",  # API names link to PyTorch's reference
    "sphinx_gallery.gen_gallery",  # runs examples/plot_*.py and renders them as pages
    "sphinx_copybutton",  # a copy button on every code cell
    "notfound.extension",  # a 404 page in the site's theme
    "not_found_links",  # the 404 page's own links work from any missing address
    "example_buttons",  # Colab, notebook and script buttons under each example's title
    "thumbnail_alt_text",  # thumbnails described by their example's first figure
    "offline_assets",  # no third-party scripts on the execution-times pages
    "api_reference",  # the API page's list of torch.func functions and their examples
]
# sphinx-gallery's downloads sit beside its pages; they are not pages.
exclude_patterns = [
    "auto_examples/**.ipynb",
    "auto_examples/**.py",
    "auto_examples/**.zip",
]
# An API name that resolves nowhere fails the build.
nitpicky = True

# PyTorch's API, from an inventory in the repository (make inventory): builds stay offline.
intersphinx_mapping = {
    "torch": ("https://docs.pytorch.org/docs/stable/", "_inventories/torch.inv"),
}

# "Run in Google Colab" opens the notebook from the branch that GitHub Pages serves. The
# repository (owner/name) comes from GitHub Actions; where it is empty the button is left out.
_repository = os.environ.get("GITHUB_REPOSITORY", "")
colab_notebooks = {"repository": _repository, "branch": "gh-pages"}
# GitHub Pages serves a project site under /<name>/; the 404 page's links must start there.
notfound_urls_prefix = f"/{_repository.partition('/')[2]}/" if _repository else "/"

html_theme = "furo"
# Our styles (buttons, figures on dark backgrounds), relative to conf.py.
html_static_path = ["docs/_static"]
html_css_files = ["site.css"]
# A missing favicon is a failed request in the browser.
html_favicon = "docs/_static/favicon.svg"
# Readers want the example downloads, not the generated reST.
html_show_sourcelink = False
# WCAG AA contrast for code, in both themes.
pygments_style = "a11y-light"
pygments_dark_style = "a11y-dark"
# Copy buttons on code cells only, never on printed output.
copybutton_selector = "div.highlight-Python pre"

sphinx_gallery_conf = {
    # Relative to docs/, the source folder; the gallery is generated and git-ignored.
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    # Run every example; or one (make html EXAMPLE=plot_name); or one shard of N, balanced by
    # the recorded run times (make html SHARD=i/N).
    "filename_pattern": filename_pattern(
        os.environ.get("GALLERY_EXAMPLE", ""), os.environ.get("GALLERY_SHARD", "")
    ),
    # Sections in reading order, and in each section the order of the index page.
    "subsection_order": [
        "../examples/start_here",
        "../examples/per_sample_gradients",
        "../examples/jacobians_and_curvature",
        "../examples/models_as_functions",
        "../examples/science",
        "../examples/guides",
    ],
    "within_subsection_order": "reading_order.ReadingOrder",
    # Notebooks open with a cell that installs what their example imports, where missing.
    "first_notebook_cell": install_cell(),
    # Before every example: reset seeds, torch's settings and matplotlib; pick its install cell.
    # A merge (make merge) stops at the first example it would execute, naming it.
    "reset_modules": (
        "gallery_shards.refuse_to_execute",
        "matplotlib",
        "reset_between_examples.reset_state",
        "notebook_install_cell.first_cell_for_example",
    ),
    # CUDA peak memory on GPU builds, nothing on the CPU.
    "show_memory": memory_reporter(),
    # Mini-galleries of the examples that use each torch name, for the API page.
    "doc_module": ("torch",),
    "backreferences_dir": "gen_modules/backreferences",
    # "Related examples" at the foot of each example page, computed offline.
    "recommender": {"enable": True, "n_examples": 3},
    # Sharp figures on high-density screens.
    "image_srcset": ["2x"],
}
