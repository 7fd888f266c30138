"""The first cell of every notebook, for sphinx-gallery's ``first_notebook_cell``.

It installs the versions the site was built with, and only where a package is missing, so it
does nothing on Google Colab or in an environment that already has PyTorch.
"""

import re
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent.parent / "requirements.txt"


def pinned_version(package, requirements_text):
    """The exact version that requirements.txt pins for ``package``."""
    match = re.search(
        rf"^{re.escape(package)}==(\S+)",
        requirements_text,
        flags=re.MULTILINE | re.IGNORECASE,
    )
    if match is None:
        raise ValueError(f"requirements.txt pins no version of {package}")
    return match.group(1)


def install_cell(packages=("torch", "matplotlib")):
    """Cell source that %pip-installs the pinned ``packages`` where any is missing."""
    text = REQUIREMENTS.read_text(encoding="utf-8")
    pins = " ".join(f"{name}=={pinned_version(name, text)}" for name in packages)
    names = ", ".join(f'"{name}"' for name in packages)
    return (
        "# Running on a machine without PyTorch? This cell installs the versions the site was\n"
        "# built with. Where they are already installed (Google Colab, most PyTorch set-ups)\n"
        "# it does nothing, so your own versions stay untouched.\n"
        "import importlib.util\n"
        "\n"
        f"if not all(importlib.util.find_spec(name) for name in ({names},)):\n"
        f"    %pip install {pins}"
    )
