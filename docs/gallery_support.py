"""Logic behind conf.py: the reset between examples, the notebook's install cell, and the
post-processing of generated pages. conf.py imports this module and stays declarative."""

import random
import re
from pathlib import Path

import torch

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
    torch.set_float32_matmul_precision("highest")  # PyTorch's default: no TF32 in matmuls
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    plt.close("all")
    matplotlib.rcdefaults()


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
    match = re.search(rf"^{re.escape(package)}==(\S+)", text, flags=re.MULTILINE | re.IGNORECASE)
    if match is None:
        raise ValueError(f"requirements.txt pins no version of {package}")
    return match.group(1)


def notebook_install_cell():
    """The first cell of every notebook: install torch and matplotlib only where missing."""
    pins = " ".join(f"{name}=={pinned_version(name)}" for name in ("torch", "matplotlib"))
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
_CDN_BLOCK = re.compile(r"\n  \.\. raw:: html\n\n(    .*\n|\n)*?(?=\n  \.\. list-table::)")


def strip_cdn_assets(app, docname, source):
    if docname.endswith("sg_execution_times"):
        source[0] = _CDN_BLOCK.sub("\n", source[0])
        if "https://" in source[0]:
            raise RuntimeError(f"{docname}: could not remove the CDN assets sphinx-gallery adds")


def setup(app):
    app.connect("source-read", strip_cdn_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
