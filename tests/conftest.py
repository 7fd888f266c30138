"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and the front door),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site), and
test_extensions.py (the site's Sphinx extensions on small inputs, in seconds).
"""

import re
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
    BUILT_TREES.append(tree)
    return Site(tree=tree, html=tree / "_build" / "html", log=log)


BUILT_TREES = []  # the site fixture's build, for the time report at the end


def example_times(execution_times_rst):
    """(seconds, example) for each example on sphinx-gallery's execution-times page."""
    rows = re.findall(
        r"\(``\.\./examples/(?:\w+/)*(plot_\w+\.py)``\)\s*\n\s*- (\d+):(\d+\.\d+)",
        execution_times_rst,
    )
    return sorted(
        ((int(minutes) * 60 + float(seconds), name) for name, minutes, seconds in rows),
        reverse=True,
    )


def pytest_terminal_summary(terminalreporter):
    """The five slowest examples of this run's build: a report, not a test."""
    if not BUILT_TREES:
        return
    times_page = BUILT_TREES[0] / "docs" / "sg_execution_times.rst"
    times = example_times(times_page.read_text(encoding="utf-8"))
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
