"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and the front door),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site), and
test_extensions.py (the site's Sphinx extensions on small inputs, in seconds).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import EXAMPLES, copy_sources, make


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
