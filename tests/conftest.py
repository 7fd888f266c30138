"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and what it produces),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site).
"""

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["conf.py", "Makefile", "requirements.txt", "docs", "examples"]
GENERATED = shutil.ignore_patterns(
    "auto_examples", "sg_execution_times.rst", "__pycache__"
)
EXAMPLES = sorted(
    p.relative_to(REPO / "examples") for p in (REPO / "examples").rglob("plot_*.py")
)


def copy_sources(destination: Path) -> Path:
    """A clean copy of what `make html` reads: no generated gallery, no earlier build."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=GENERATED)
        else:
            shutil.copy2(source, destination / name)
    return destination


# The repository the tests pretend to publish from: it turns on the "Run in Google Colab" button.
TEST_REPOSITORY = "example-owner/torch-func-by-example"


def make(
    tree: Path, *args: str, repository: str = TEST_REPOSITORY, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Run the real front door, `make ...`, in `tree` with this interpreter."""
    command = ["make", "-C", str(tree), *args, f"PY={sys.executable}", "NEEDS="]
    env = {**os.environ, "GITHUB_REPOSITORY": repository}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env
    )


@dataclass
class Site:
    tree: Path  # the copy of the sources that was built
    html: Path  # the built site
    log: str  # everything `make html` printed

    def page(self, example: Path) -> Path:
        return self.html / "auto_examples" / example.with_suffix(".html")


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    tree = copy_sources(tmp_path_factory.mktemp("site"))
    result = make(tree, "html")
    log = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(
            f"`make html` failed with exit code {result.returncode}:\n{log[-6000:]}"
        )
    return Site(tree=tree, html=tree / "_build" / "html", log=log)


def pytest_collection_modifyitems(items):
    if not EXAMPLES:
        raise pytest.UsageError(
            "no examples/**/plot_*.py found: nothing would be tested"
        )
