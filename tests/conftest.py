"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and the front door),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site), and
test_extensions.py (the site's Sphinx extensions on small inputs, in seconds).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import EXAMPLES, copy_sources, make, times_from_execution_page


@dataclass
class Site:
    tree: Path  # the copy of the sources that was built
    html: Path  # the built site
    log: str  # everything `make html` printed
    merged: bool = False  # built by `make merge` from shards: it executed no example

    def page(self, example: Path) -> Path:
        return self.html / "auto_examples" / example.with_suffix(".html")


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    """The site the tests read: built here from a clean copy, or, with SITE_TREE=path, the one
    that `make html` or `make merge` built in that tree (CI tests the merge of its shards)."""
    if os.environ.get("SITE_TREE"):
        return built_site(Path(os.environ["SITE_TREE"]).resolve())
    tree = copy_sources(tmp_path_factory.mktemp("site"))
    result = make(tree, "html")
    log = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(
            f"`make html` failed with exit code {result.returncode}:\n{log[-6000:]}"
        )
    BUILT_TREES.append(tree)
    return Site(tree=tree, html=tree / "_build" / "html", log=log)


BUILT_TREES = []  # the site fixture's build, for the time report at the end


def built_site(tree):
    log_path = tree / "_build" / "sphinx.log"
    log = log_path.read_text(encoding="utf-8") if log_path.is_file() else ""
    if "Built the site" not in log:
        pytest.fail(
            f"SITE_TREE={tree} holds no finished build ({log_path}): run `make html` or "
            "`make merge FROM=...` there first"
        )
    merged = "Built the site from the shards" in log
    return Site(tree=tree, html=tree / "_build" / "html", log=log, merged=merged)


def pytest_terminal_summary(terminalreporter):
    """The five slowest examples of this run's build: a report, not a test."""
    if not BUILT_TREES:
        return
    times_page = BUILT_TREES[0] / "docs" / "sg_execution_times.rst"
    times = sorted(
        (
            (seconds, name)
            for name, seconds in times_from_execution_page(
                times_page.read_text(encoding="utf-8")
            ).items()
        ),
        reverse=True,
    )
    terminalreporter.section(
        "five slowest examples (from sphinx-gallery's execution times)"
    )
    for seconds, name in times[:5]:
        terminalreporter.write_line(f"{seconds:6.1f} s  {name}")
    terminalreporter.write_line(
        f"{sum(s for s, _ in times):6.1f} s  all {len(times)} examples"
    )


def pytest_collection_modifyitems(items):
    if not EXAMPLES:
        raise pytest.UsageError(
            "no examples/**/plot_*.py found: nothing would be tested"
        )
