"""Shared fixtures: one real build of the site per test run, from a clean copy of the sources.

Tests are grouped by what a user does: test_building.py (make html and the front door),
test_downloading.py (the notebooks and scripts a reader downloads), test_browsing.py (the
pages in a real browser), test_workflows.py (the CI that builds and publishes the site), and
test_extensions.py (the site's Sphinx extensions on small inputs, in seconds).
"""

import contextlib
import itertools
import os
import queue
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from signal import SIGHUP, SIGTERM, signal

import nbformat
import pytest
from helpers import (
    EXAMPLES,
    copy_sources,
    make_command,
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
def site(site_build) -> Site:
    """The site the tests read: built here from a clean copy (see site_build), or, with
    SITE_TREE=path, the one that `make html` or `make merge` built in that tree (CI tests the
    merge of its shards)."""
    return site_build.result()


@pytest.fixture(scope="session", autouse=True)
def site_build(request, tmp_path_factory, notebooks):
    """Starts the one build of the site as the session starts, when a selected test reads it.

    It builds in the background: the tests that do not read the site run meanwhile (they are
    collected first), and each selected example's notebook starts in a kernel as soon as the
    build has written it (see NotebookRunner)."""
    if os.environ.get("SITE_TREE"):
        yield BuiltTree(Path(os.environ["SITE_TREE"]).resolve(), notebooks)
        return
    if not any(reads_the_site(item) for item in request.session.items):
        yield None
        return
    build = SiteBuild(copy_sources(tmp_path_factory.mktemp("site")), notebooks)
    # The site's build is the longest path through the run: the tests yield to it (on Linux
    # nice is per thread: this thread, and what it starts from now on); `make`, started
    # already, keeps its priority.
    os.nice(TESTS_NICENESS)
    # The build has a process group of its own: a SIGTERM or SIGHUP to the run's group no
    # longer reaches it, so they end the session as Ctrl-C does, through this teardown.
    stopping = {sig: signal(sig, interrupt) for sig in (SIGTERM, SIGHUP)}
    try:
        yield build
    finally:
        build.stop()
        for sig, handler in stopping.items():
            signal(sig, handler)


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def reads_the_site(item):
    return "site" in getattr(item, "fixturenames", ())


class SiteBuild:
    """`make html` in `tree`, on one thread, watched by a background thread; result() waits
    for it, stop() ends it if the session ends first (pytest -x, Ctrl-C)."""

    def __init__(self, tree, notebooks):
        self.tree, self.notebooks = tree, notebooks
        command, env = make_command(tree, "html", env={"OMP_NUM_THREADS": "1"})
        # Its own process group, to stop it with what it started; the same session, so that
        # it keeps sharing the CPU with this one as a foreground job would.
        self.process = subprocess.Popen(
            command, env=env, text=True, process_group=0, **PIPES
        )
        self.outcome = Future()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        try:
            self.outcome.set_result(self._run())
        except BaseException as error:  # raised again by result(), in the tests
            self.notebooks.cancel()
            self.outcome.set_exception(error)

    def _run(self):
        started = time.monotonic()
        while True:
            self.notebooks.offer_written(self.tree)
            try:
                stdout, stderr = self.process.communicate(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - started > BUILD_TIMEOUT_S:
                    self.stop()
                    stdout, stderr = self.process.communicate()
                    self.notebooks.cancel()
                    return (
                        f"`make html` ran past {BUILD_TIMEOUT_S} s and was stopped:\n"
                        f"{(stdout + stderr)[-6000:]}"
                    )
        log = stdout + stderr
        if self.process.returncode != 0:
            self.notebooks.cancel()
            return (
                f"`make html` failed with exit code {self.process.returncode}:\n"
                f"{log[-6000:]}"
            )
        self.notebooks.all_built(self.tree)
        BUILT_TREES.append(self.tree)
        return Site(tree=self.tree, html=self.tree / "_build" / "html", log=log)

    def result(self) -> Site:
        outcome = self.outcome.result()
        if isinstance(outcome, str):
            pytest.fail(outcome)
        return outcome

    def stop(self):
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.killpg(self.process.pid, SIGTERM)


PIPES = {
    "stdin": subprocess.DEVNULL,
    "stdout": subprocess.PIPE,
    "stderr": subprocess.PIPE,
}
BUILD_TIMEOUT_S = 1800


class BuiltTree:
    """SITE_TREE's site, built before the tests: its notebooks start at once, beside them."""

    def __init__(self, tree, notebooks):
        self.site = self.failure = None
        try:
            self.site = built_site(tree)
        except pytest.fail.Exception as failure:
            self.failure = failure  # each test that reads the site reports it
            notebooks.cancel()
        else:
            notebooks.all_built(tree)

    def result(self) -> Site:
        if self.failure is not None:
            raise self.failure
        return self.site


BUILT_TREES = []  # the site's build, for the time report at the end

# Every downloaded notebook runs again in a real kernel (test_downloading.py), one thread each:
# two kernels of two threads on two cores slow each other down many times over. Timings are
# never asserted, so the thread count changes no checked result. Two kernels run the notebooks
# from the first one the build writes, beside the build and the other tests. They are not given
# a lower priority: jupyter_client starts each kernel in a session of its own, and with Linux's
# autogroup scheduling a session shares the CPU with others whatever its processes' nice value.
# Their tests are collected last and only wait for them.
KERNELS = 2
TESTS_NICENESS = 5
NOTEBOOK_TEST = "test_notebook_runs_top_to_bottom_in_a_fresh_kernel"
CELL_TIMEOUT_S = 300
POLL_S = 2.0


def execute_notebook(text, workdir):
    """Run one notebook (its file's text) in a fresh kernel, as Jupyter would; return it,
    run."""
    notebook = nbformat.reads(text, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
        shutdown_kernel="immediate",  # the kernel is done with: no wait for it to exit
    )
    # One thread per kernel (see KERNELS); raises on the first error cell.
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1"})
    return notebook


class NotebookRunner:
    """Runs the selected examples' notebooks in kernels, each as soon as the build wrote it.

    The build writes an example's notebook (docs/auto_examples/<section>/<name>.ipynb, by a
    rename, so never half-written) right after running the example, and copies it into the
    site's downloads at the end; the notebook test checks that the download is the file that
    ran. `futures` maps each example to the future of its run notebook."""

    def __init__(self, examples, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.waiting = list(examples)
        self.futures = {example: Future() for example in examples}
        self.ran_bytes = {}  # example: the bytes of the notebook file its kernel ran
        # Of the notebooks written, the slowest first (by the recorded times), so that the
        # kernels finish together; then a stop for each kernel.
        self.recorded = read_times()
        self.ready = queue.PriorityQueue()
        self.order = itertools.count()
        self.kernels = [self._start_kernel() for _ in range(KERNELS)]

    def _start_kernel(self):
        kernel = threading.Thread(target=self._run_kernels, daemon=True)
        kernel.start()
        return kernel

    def _run_kernels(self):
        while (item := self.ready.get())[2] is not None:
            _, _, example, text, workdir = item
            future = self.futures[example]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(execute_notebook(text, workdir))
            except BaseException as error:  # re-raised by the notebook's own test
                future.set_exception(error)

    def offer_written(self, tree):
        """Queue every waiting example whose notebook the build in `tree` has written."""
        for example in list(self.waiting):
            path = tree / "docs" / "auto_examples" / example.with_suffix(".ipynb")
            if path.is_file():
                self.waiting.remove(example)
                self.ran_bytes[example] = path.read_bytes()
                text = self.ran_bytes[example].decode("utf-8")
                seconds = self.recorded.get(example.name, 60.0)
                workdir = self.tmp_path_factory.mktemp(example.stem)
                self.ready.put((-seconds, next(self.order), example, text, workdir))

    def all_built(self, tree):
        """The build is over: queue the rest."""
        self.offer_written(tree)
        for example in self.waiting:  # not written: their tests say so
            self.futures[example].set_exception(
                FileNotFoundError(f"the build wrote no notebook for {example}")
            )
        self.waiting = []

    def cancel(self):
        for future in self.futures.values():
            future.cancel()

    def stop(self):
        for _ in self.kernels:
            self.ready.put((float("inf"), next(self.order), None, None, None))
        for kernel in self.kernels:
            kernel.join()


@pytest.fixture(scope="session")
def notebooks(request, tmp_path_factory):
    """The NotebookRunner for the notebook tests this run selected; it runs nothing when
    none is."""
    selected = [
        item.callspec.params["example"]
        for item in request.session.items
        if getattr(item, "originalname", None) == NOTEBOOK_TEST
    ]
    runner = NotebookRunner(selected, tmp_path_factory)
    yield runner
    runner.cancel()
    runner.stop()


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
        "five slowest examples (sphinx-gallery's times; the build ran on one thread)"
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
    # First the tests that do not read the site, while it builds; then those that do; the
    # notebook tests last: by then their notebooks have run beside the other tests.
    items.sort(
        key=lambda item: (
            getattr(item, "originalname", None) == NOTEBOOK_TEST,
            reads_the_site(item),
        )
    )
