"""What the tests share: where things are, a clean copy of the sources, and the front door."""

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bs4 import BeautifulSoup

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["conf.py", "Makefile", "requirements.txt", "docs", "examples", "tools"]
GENERATED = shutil.ignore_patterns(
    "auto_examples", "gen_modules", "sg_execution_times.rst", "__pycache__"
)
# Each example as a path relative to examples/: the gallery's sections are its folders.
EXAMPLES = sorted(
    p.relative_to(REPO / "examples") for p in (REPO / "examples").rglob("plot_*.py")
)


sys.path.insert(0, str(REPO / "docs" / "sphinxext"))
from gallery_shards import (  # noqa: E402
    read_times,  # noqa: F401 (for conftest)
    shard_examples,
    times_from_execution_page,  # noqa: F401 (for conftest)
)


def shard_of(examples, shard):
    """The examples that `make html SHARD=i/N` executes; all of them when shard is empty."""
    if not shard:
        return list(examples)
    chosen = shard_examples(shard)
    return [e for e in examples if e.name in chosen]


# The notebooks this run executes: all, or one shard's (`make test-shard SHARD=i/N` on CI).
NOTEBOOK_EXAMPLES = shard_of(EXAMPLES, os.environ.get("GALLERY_SHARD", ""))


def example_path(name: str) -> Path:
    """An example's path relative to examples/, from its file name."""
    (path,) = [example for example in EXAMPLES if example.name == name]
    return path


# The repository the site is published from: it turns on the "Run in Google Colab" button. On
# GitHub Actions, the one that runs (a merged site from CI's shards was built with it); else one
# the tests pretend to publish from.
TEST_REPOSITORY = (
    os.environ.get("GITHUB_REPOSITORY") or "example-owner/torch-func-by-example"
)
# GitHub Pages serves that repository's site under this path, and so does the test server.
PAGES_PREFIX = f"/{TEST_REPOSITORY.partition('/')[2]}/"


def copy_sources(destination: Path, examples=None) -> Path:
    """A clean copy of what `make html` reads: no generated gallery, no earlier build.

    With `examples` (file names), the copy holds only those examples.
    """
    destination.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=GENERATED)
        else:
            shutil.copy2(source, destination / name)
    if examples is not None:
        for example in (destination / "examples").rglob("plot_*.py"):
            if example.name not in examples:
                example.unlink()
    return destination


def make(
    tree: Path,
    *args: str,
    repository: str = TEST_REPOSITORY,
    timeout: float = 900,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the real front door, `make ...`, in `tree` with this interpreter (and, with `env`,
    these environment variables too)."""
    command, env = make_command(tree, *args, repository=repository, env=env)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env
    )


def make_command(tree, *args, repository=TEST_REPOSITORY, env=None):
    """The command line and environment of `make(tree, *args, ...)`."""
    command = ["make", "-C", str(tree), *args, f"PY={sys.executable}", "NEEDS="]
    return command, {**os.environ, "GITHUB_REPOSITORY": repository, **(env or {})}


def downloaded(site, name):
    """The one file called `name` among the built site's downloads."""
    matches = list((site.html / "_downloads").rglob(name))
    assert len(matches) == 1, f"expected one {name} in _downloads, found {matches}"
    return matches[0]


def soup(path):
    """The parsed page, parsed once per version of the file: the tests only read it, and
    parsing a long example page takes a large part of a second."""
    path = Path(path).resolve()
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _parsed(path, mtime_ns, size):
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


MINIMAL_INDEX = """A small site
============

.. toctree::

   auto_examples/index
   api
   questions
   reading-timings
   building
   sg_execution_times
"""


def small_site(tmp_path, examples=("plot_extending_torch_func.py",)):
    """A copy of the sources with one quick example and an index that lists no other."""
    tree = copy_sources(tmp_path, examples=set(examples))
    (tree / "docs" / "index.rst").write_text(MINIMAL_INDEX, encoding="utf-8")
    return tree
