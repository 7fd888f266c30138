"""The first cell of every notebook, for sphinx-gallery's ``first_notebook_cell``.

It installs the versions the site was built with, and only where a package is missing, so it
does nothing on Google Colab or in an environment that already has what the example needs.
Each notebook's cell names exactly the packages its example imports (torch and matplotlib for
most, plus Opacus or scikit-learn for some): ``first_cell_for_example`` sets it through
sphinx-gallery's ``reset_modules`` hook, which runs before each example is executed.
"""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent.parent
REQUIREMENTS = REPOSITORY / "requirements.txt"
EXAMPLES = REPOSITORY / "examples"
DEFAULT_PACKAGES = (("torch", "torch"), ("matplotlib", "matplotlib"))


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


def needed_packages(source):
    """(import name, distribution) for each third-party package that ``source`` imports."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.partition(".")[0])
    distributions = importlib.metadata.packages_distributions()
    return tuple(
        (module, distributions[module][0])
        for module in sorted(modules - set(sys.stdlib_module_names))
        if module in distributions
    )


def install_cell(packages=DEFAULT_PACKAGES):
    """Cell source that %pip-installs each pinned package of ``packages`` that is missing.

    ``packages`` holds (import name, distribution name) pairs: scikit-learn is imported as
    sklearn. Packages already present are left alone, whatever their version.
    """
    text = REQUIREMENTS.read_text(encoding="utf-8")
    pins = "".join(
        f'    "{module}": "{dist}=={pinned_version(dist, text)}",\n'
        for module, dist in packages
    )
    return (
        "# Running on a machine without some of these packages? This cell installs the\n"
        "# versions the site was built with, and only the missing ones: where a package is\n"
        "# already installed (Google Colab has torch), your own version stays untouched.\n"
        "import importlib.util\n"
        "\n"
        "pinned = {\n"
        f"{pins}"
        "}\n"
        "missing = [pin for name, pin in pinned.items() if not importlib.util.find_spec(name)]\n"
        "if missing:\n"
        '    %pip install {" ".join(missing)}'
    )


def first_cell_for_example(gallery_conf, fname):
    """``reset_modules`` hook: the coming notebook installs what this example imports."""
    if fname is None:  # entering a folder of examples, not an example
        return
    (example,) = EXAMPLES.rglob(Path(fname).name)  # the sections are subfolders
    source = example.read_text(encoding="utf-8")
    gallery_conf["first_notebook_cell"] = install_cell(needed_packages(source))
