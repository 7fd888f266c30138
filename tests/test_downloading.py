"""What a reader downloads from the built site: notebooks, scripts and zips, run for real."""

import ast
import os
import re
import subprocess
import sys
import zipfile

import nbformat
import pytest
from bs4 import BeautifulSoup
from helpers import (
    EXAMPLES,
    NOTEBOOK_EXAMPLES,
    REPO,
    TEST_REPOSITORY,
    downloaded,
    example_path,
    make,
    small_site,
)
from nbclient import NotebookClient


@pytest.mark.parametrize("example", NOTEBOOK_EXAMPLES, ids=str)
def test_notebook_runs_top_to_bottom_in_a_fresh_kernel(site, notebooks, example):
    # Each notebook started as soon as the build wrote it (conftest.py); this test runs last,
    # waits for this one, and re-raises its first error.
    notebook = notebooks.futures[example].result()
    # What ran is what a reader downloads.
    assert (
        notebooks.ran_bytes[example]
        == downloaded(site, f"{example.stem}.ipynb").read_bytes()
    )
    errors = [
        out
        for cell in notebook.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    printed = "".join(
        out.get("text", "")
        for cell in notebook.cells
        for out in cell.get("outputs", [])
    )
    assert "torch " in printed and "threads" in printed, (
        "the notebook did not print its hardware"
    )
    figures = [
        out
        for cell in notebook.cells
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert figures, "the notebook drew no figure"


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_script_is_the_example_itself(site, example):
    """The download is the source that the build ran (and the notebook test runs again)."""
    script = downloaded(site, f"{example.stem}.py")
    assert script.read_bytes() == (REPO / "examples" / example).read_bytes()


def test_a_script_runs_with_plain_python(site, tmp_path):
    """Outside Sphinx and Jupyter: no __file__ tricks, no IPython. The quickest example."""
    script = downloaded(site, "plot_batch_jacobians_hessians.py")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "threads" in result.stdout


# Run before a notebook's install cell: %pip only records what it was asked to install, and
# the packages named in HIDDEN look missing, as on a machine without them.
FAKE_MACHINE = """
import importlib.util
from IPython.core.magic import register_line_magic

pip_calls = []


def pip(line):
    pip_calls.append(line)


register_line_magic(pip)  # replaces the real %pip in this kernel
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: (
    None if name in HIDDEN else real_find_spec(name, *args)
)
"""


def pip_lines_of_install_cells(site, cases, tmp_path):
    """For each (example, hidden packages): the %pip lines its notebook's first cell runs.

    One kernel runs them all: before each install cell, the packages in `hidden` are made to
    look missing and the record of %pip calls is cleared.
    """
    cells = [nbformat.v4.new_code_cell(f"HIDDEN = []\n{FAKE_MACHINE}")]
    for example, hidden in cases:
        notebook = nbformat.read(
            downloaded(site, f"{example.stem}.ipynb"), as_version=4
        )
        install = next(cell for cell in notebook.cells if cell.cell_type == "code")
        cells += [
            nbformat.v4.new_code_cell(
                f"HIDDEN[:] = {sorted(hidden)!r}\npip_calls.clear()"
            ),
            install,
            nbformat.v4.new_code_cell("print(repr(pip_calls))"),
        ]
    run = nbformat.v4.new_notebook(cells=cells)
    client = NotebookClient(
        run,
        timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    return [ast.literal_eval(cell.outputs[0]["text"]) for cell in run.cells[3::3]]


def test_each_notebook_installs_exactly_what_its_example_imports_where_missing(
    site, tmp_path
):
    requirements = (REPO / "requirements.txt").read_text(encoding="utf-8")
    extras = {
        "opacus": "opacus",
        "sklearn": "scikit-learn",
        "numpy": "numpy",
        "jax": "jax",
    }

    def pin(dist):
        return re.search(rf"^{dist}==\S+", requirements, re.M).group(0)

    cases, expected = [], []
    for example in EXAMPLES:
        source = (REPO / "examples" / example).read_text(encoding="utf-8")
        imported = {
            m for m in extras if re.search(rf"^(from|import) {m}\b", source, re.M)
        }
        hidden = {
            "torch",
            *imported,
        }  # matplotlib stays: present packages are left alone
        cases += [(example, set()), (example, hidden)]
        pins = sorted(pin({"torch": "torch", **extras}[module]) for module in hidden)
        expected += [[], pins]
    for (example, hidden), lines, pins in zip(
        cases, pip_lines_of_install_cells(site, cases, tmp_path), expected
    ):
        if not pins:
            assert lines == [], f"{example}: installs although nothing is missing"
        else:
            (line,) = lines
            assert line.split()[0] == "install", f"{example}: {line}"
            assert sorted(line.split()[1:]) == pins, (
                f"{example} hiding {hidden}: {line}"
            )


@pytest.mark.parametrize("kind", ["python", "jupyter"])
def test_zip_of_all_examples_holds_every_example(site, kind):
    suffix = {"python": ".py", "jupyter": ".ipynb"}[kind]
    archive = downloaded(site, f"auto_examples_{kind}.zip")
    with zipfile.ZipFile(archive) as zipped:
        names = sorted(
            name.rsplit("/", 1)[-1]
            for name in zipped.namelist()
            if name.endswith(suffix)
        )
    assert names == sorted(f"{example.stem}{suffix}" for example in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_buttons_under_the_title_run_in_colab_and_download(site, example):
    page = BeautifulSoup(site.page(example).read_text(encoding="utf-8"), "html.parser")
    buttons = page.select_one("p.example-buttons")
    assert buttons is not None, f"{example}: no buttons"
    title = page.select_one("h1")
    assert title.find_next("p") is buttons, (
        "the buttons are not the first thing under the title"
    )
    links = {a.get_text(" ", strip=True): a["href"] for a in buttons.select("a")}
    assert list(links) == [
        "Run in Google Colab",
        "Download notebook",
        "Download Python source",
    ]

    colab = re.fullmatch(
        rf"https://colab\.research\.google\.com/github/{re.escape(TEST_REPOSITORY)}"
        rf"/blob/gh-pages/(_downloads/[0-9a-f]{{32}}/{example.stem}\.ipynb)",
        links["Run in Google Colab"],
    )
    assert colab, links["Run in Google Colab"]
    assert (site.html / colab.group(1)).is_file(), (
        "Colab would open a notebook the site lacks"
    )
    for text, suffix in [
        ("Download notebook", ".ipynb"),
        ("Download Python source", ".py"),
    ]:
        target = (site.page(example).parent / links[text]).resolve()
        assert target.is_file() and target.name == example.stem + suffix


def test_without_a_repository_the_colab_button_is_left_out_quietly(tmp_path):
    shown = ["plot_batch_jacobians_hessians.py", "plot_extending_torch_func.py"]
    tree = small_site(tmp_path, examples=shown)
    result = make(tree, "html-noplot", repository="")
    assert result.returncode == 0, (result.stdout + result.stderr)[
        -3000:
    ]  # -W: no warning
    for example in shown:
        html = (
            (tree / "_build/html/auto_examples" / example_path(example))
            .with_suffix(".html")
            .read_text()
        )
        page = BeautifulSoup(html, "html.parser")
        buttons = [
            a.get_text(" ", strip=True) for a in page.select("p.example-buttons a")
        ]
        assert buttons == ["Download notebook", "Download Python source"], buttons
        assert "colab.research.google.com" not in html
