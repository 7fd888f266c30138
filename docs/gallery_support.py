"""Logic behind conf.py, which imports this module and stays declarative.

Used by sphinx-gallery: the reset between examples, the reading order, the notebooks' install
cell, CUDA peak memory. As a Sphinx extension: the buttons under each example's title, the
thumbnails' alt text, links from API names to PyTorch's reference, and no third-party assets
on the execution-times pages."""

import hashlib
import random
import re
from pathlib import Path

import torch
from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError

REPO_ROOT = Path(__file__).resolve().parent.parent
_DEFAULT_THREADS = torch.get_num_threads()


def reset_state(gallery_conf, fname):
    """Give every example the same fresh start: seeds, torch's global settings, matplotlib.

    sphinx-gallery runs all examples in one process, so without this an example that changes
    the default dtype, disables grad or sets a seed would leak that into the next one.
    """
    import matplotlib
    import matplotlib.pyplot as plt
    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # seeds CUDA too
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(_DEFAULT_THREADS)
    torch.use_deterministic_algorithms(False)
    # PyTorch's defaults: no TF32 in matrix products, TF32 allowed in cuDNN convolutions.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    plt.close("all")
    matplotlib.rcdefaults()


class ReadingOrder:
    """Order the gallery as the index page lists the examples, the order they teach in.

    sphinx-gallery calls this with each example's file name. An example that the index does not
    list yet goes last, by name.
    """

    def __init__(self, src_dir):
        index = (REPO_ROOT / "docs" / "index.rst").read_text(encoding="utf-8")
        self.order = re.findall(r":doc:`auto_examples/(plot_\w+)`", index)

    def __call__(self, filename):
        stem = Path(filename).stem
        rank = self.order.index(stem) if stem in self.order else len(self.order)
        return (rank, filename)

    def __repr__(self):
        # A stable repr, so that Sphinx does not see a changed config at every build.
        return "ReadingOrder"


def cuda_peak_memory(example):
    """sphinx-gallery's show_memory hook: run the example, report its CUDA peak in MiB."""
    torch.cuda.reset_peak_memory_stats()
    result = example()
    return torch.cuda.max_memory_allocated() / 2**20, result


def memory_reporter():
    """CUDA peak memory where a GPU builds the site; nothing on a CPU, where it would mislead."""
    return cuda_peak_memory if torch.cuda.is_available() else False


def pinned_version(package):
    """The exact version requirements.txt pins for ``package``."""
    text = (REPO_ROOT / "requirements.txt").read_text()
    match = re.search(
        rf"^{re.escape(package)}==(\S+)", text, flags=re.MULTILINE | re.IGNORECASE
    )
    if match is None:
        raise ValueError(f"requirements.txt pins no version of {package}")
    return match.group(1)


def notebook_install_cell():
    """The first cell of every notebook: install torch and matplotlib only where missing."""
    pins = " ".join(
        f"{name}=={pinned_version(name)}" for name in ("torch", "matplotlib")
    )
    return (
        "# Running on a machine without PyTorch? This cell installs the versions the site was\n"
        "# built with. Where torch and matplotlib are already installed (Google Colab, most\n"
        "# PyTorch set-ups) it does nothing, so your own versions stay untouched.\n"
        "import importlib.util\n"
        "\n"
        'if not all(importlib.util.find_spec(name) for name in ("torch", "matplotlib")):\n'
        f"    %pip install {pins}"
    )


# sphinx-gallery's execution-times pages load jQuery, DataTables and Bootstrap from CDNs. The
# site loads nothing from third parties, so the raw HTML block that does it is cut out; the
# table itself is plain reST and stays.
_CDN_BLOCK = re.compile(
    r"\n  \.\. raw:: html\n\n(    .*\n|\n)*?(?=\n  \.\. list-table::)"
)


def strip_cdn_assets(app, docname, source):
    if docname.endswith("sg_execution_times"):
        source[0] = _CDN_BLOCK.sub("\n", source[0])
        if "https://" in source[0]:
            raise ExtensionError(f"{docname}: CDN assets left after stripping them")


# Example pages open with three buttons under the title, where a reader looks first: run in
# Google Colab, download the notebook, download the script. They replace sphinx-gallery's
# "Go to the end to download" note.
_EXAMPLE_PAGE = re.compile(r"auto_examples/(.+/)?plot_\w+")
_GO_TO_THE_END = re.compile(
    r"\.\. only:: html\n\n    \.\. note::\n        :class: sphx-glr-download-link-note\n"
    r".*?to download the full example code\.\n",
    flags=re.DOTALL,
)
_TITLE = re.compile(r"^\.\. _sphx_glr_.*\.py:\n\n+.+\n=+\n", flags=re.MULTILINE)


def add_example_buttons(app, docname, source):
    if not _EXAMPLE_PAGE.fullmatch(docname):
        return
    name = docname.rsplit("/", 1)[-1]
    text, notes = _GO_TO_THE_END.subn("", source[0])
    title = _TITLE.search(text)
    if notes != 1 or title is None:
        raise ExtensionError(
            f"{docname}: sphinx-gallery's page layout changed; buttons not added"
        )
    buttons = (
        "\n.. rst-class:: example-buttons\n\n"
        f":colab:`{name}.ipynb` :download:`Download notebook <{name}.ipynb>` "
        f":download:`Download Python source <{name}.py>`\n\n"
    )
    source[0] = text[: title.end()] + buttons + text[title.end() :]


def colab_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``:colab:`plot_x.ipynb``` -> a "Run in Google Colab" link, or nothing if no repository."""
    if not inliner.document.settings.env.config.colab_notebooks.get("repository"):
        return [], []  # no published notebooks to point at: leave the button out
    link = nodes.reference(
        rawtext, "Run in Google Colab", refuri="#", classes=["colab-button"]
    )
    link["colab_notebook"] = text
    return [link], []


def fill_colab_links(app, doctree, docname):
    """Point each Colab link at the notebook's path in the published site's branch."""
    published = {
        node["reftarget"]: node[
            "filename"
        ]  # e.g. "3f2a.../plot_x.ipynb", under _downloads/
        for node in doctree.findall(addnodes.download_reference)
        if "filename" in node
    }
    where = app.config.colab_notebooks
    for link in doctree.findall(nodes.reference):
        if "colab_notebook" in link:
            if link["colab_notebook"] not in published:
                raise ExtensionError(
                    f"{docname}: no download of {link['colab_notebook']}"
                )
            link["refuri"] = (
                f"https://colab.research.google.com/github/{where['repository']}"
                f"/blob/{where['branch']}/_downloads/{published[link['colab_notebook']]}"
            )


# sphinx-gallery leaves the thumbnails' alt text empty. Each thumbnail shows the example's first
# figure, so it gets that figure's alt text, which describes what the figure shows.
_THUMBNAIL = re.compile(
    r"(\.\. image:: /auto_examples/images/thumb/sphx_glr_(\w+)_thumb\.(?:png|svg)\n +:alt:)[^\n]*"
)
_FIGURE_ALT = re.compile(r"^ +:alt: (.+)$", flags=re.MULTILINE)


def describe_thumbnails(app, docname, source):
    if docname != "auto_examples/index":
        return

    def with_alt(match):
        example_page = Path(app.srcdir) / "auto_examples" / f"{match.group(2)}.rst"
        first_figure = _FIGURE_ALT.search(example_page.read_text(encoding="utf-8"))
        if first_figure is None:  # make html-noplot: the example did not run
            return f"{match.group(1)} Placeholder: this build did not run the example"
        return f"{match.group(1)} {first_figure.group(1)}"

    source[0] = _THUMBNAIL.sub(with_alt, source[0])


# API names in the prose (:func:`~torch.func.vmap`) link to PyTorch's own reference. Builds
# are offline, so no intersphinx inventory is fetched: PyTorch documents each function on a
# page of its own name, and the few modules we name are listed here.
PYTORCH_DOCS = "https://docs.pytorch.org/docs/stable/"
PYTORCH_MODULE_PAGES = {
    "torch.func": "func.html",
    "torch.utils.benchmark": "benchmark_utils.html",
}


def link_pytorch_api(app, env, node, contnode):
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("torch."):
        return None
    if node["reftype"] == "mod":
        if target not in PYTORCH_MODULE_PAGES:
            raise ExtensionError(f"no PyTorch page known for module {target}: add it")
        uri = PYTORCH_DOCS + PYTORCH_MODULE_PAGES[target]
    else:
        uri = f"{PYTORCH_DOCS}generated/{target}.html#{target}"
    return nodes.reference(
        "", "", contnode, refuri=uri, reftitle=target, internal=False
    )


def setup(app):
    # Sphinx re-reads every page when a config value changes, but not when this module does;
    # its digest as a config value makes an edit here rebuild the pages it shapes.
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    app.add_config_value("gallery_support_digest", digest, "env")
    app.add_config_value(
        "colab_notebooks", {"repository": "", "branch": "gh-pages"}, "html"
    )
    app.add_role("colab", colab_role)
    app.connect("source-read", strip_cdn_assets)
    app.connect("source-read", add_example_buttons)
    app.connect("source-read", describe_thumbnails)
    app.connect("doctree-resolved", fill_colab_links)
    app.connect("missing-reference", link_pytorch_api)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
