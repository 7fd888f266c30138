"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and the front door),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site), and
test_extensions.py (the site's Sphinx extensions on small inputs, in seconds).
"""

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from helpers import (
    EXAMPLES,
    copy_sources,
    downloaded,
    make,
    read_times,
    times_from_execution_page,
)
from nbclient import NotebookClient


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

# Every downloaded notebook runs again in a real kernel (test_downloading.py). They start as soon
# as the site is built and run in the background while the other tests run, whose browser, make
# and server waits leave cores idle; their tests are collected last and only wait for them.
# Two kernels at a time, one thread each: two kernels of two threads on two cores slow each
# other down many times over. Timings are never asserted, so the thread count changes no
# checked result.
NOTEBOOK_WORKERS = 2
NOTEBOOK_TEST = "test_notebook_runs_top_to_bottom_in_a_fresh_kernel"
CELL_TIMEOUT_S = 300


def execute_notebook(path, workdir):
    """Run one downloaded notebook in a fresh kernel, as Jupyter would; return it, run."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    # One thread per kernel (see NOTEBOOK_WORKERS); raises on the first error cell.
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1"})
    return notebook


@pytest.fixture(scope="session", autouse=True)
def running_notebooks(request, tmp_path_factory):
    """{example: future of its run notebook} for the notebook tests this run selected, started
    right after the site is built, slowest first (by the recorded times), so that the two
    kernels finish together; {} without building anything when none is selected."""
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if getattr(item, "originalname", None) == NOTEBOOK_TEST
    ]
    if not selected:
        yield {}
        return
    site = request.getfixturevalue("site")
    recorded = read_times()
    selected.sort(key=lambda example: -recorded.get(example.name, 60.0))
    pool = ThreadPoolExecutor(NOTEBOOK_WORKERS)
    futures = {
        example: pool.submit(
            execute_notebook,
            downloaded(site, f"{example.stem}.ipynb"),
            tmp_path_factory.mktemp(example.stem),
        )
        for example in selected
    }
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


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
    # The notebook tests last: by then their notebooks have run beside the other tests.
    items.sort(key=lambda item: getattr(item, "originalname", None) == NOTEBOOK_TEST)
