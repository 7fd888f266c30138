"""What `make html` produces, and how it fails."""

import re

import nbformat
import pytest
import torch
from bs4 import BeautifulSoup
from conftest import EXAMPLES, REPO, copy_sources, make


def soup(path):
    return BeautifulSoup(path.read_text(encoding="utf-8"), "html.parser")


def test_make_html_says_where_to_open_the_site(site):
    assert "Built the site: open " in site.log
    assert (site.html / "index.html").is_file()
    assert f"executed {len(EXAMPLES)} out of {len(EXAMPLES)} files" in site.log


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_page_shows_its_run(site, example):
    page = soup(site.page(example))
    outputs = page.select("div.sphx-glr-script-out pre")
    assert outputs, f"{example}: no printed output on the page"
    first_output = outputs[0].get_text()
    assert re.search(
        r"(CPU|GPU): .+ \| torch \d+\.\d+\.\d+.* \| \d+ threads", first_output
    ), f"{example}: the first output does not say where it ran:\n{first_output}"
    figures = [
        img
        for img in page.select("img")
        if f"sphx_glr_{example.stem}_0" in img.get("src", "")
    ]
    assert figures, f"{example}: no figure on the page"
    for img in figures:
        assert (site.page(example).parent / img["src"]).is_file(), img["src"]
    running_time = page.find(string=re.compile("Total running time of the script"))
    assert running_time is not None, f"{example}: no running-time line"
    assert re.search(
        r"\(\d+ minutes \d+\.\d+ seconds\)", running_time.find_parent("p").get_text()
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_page_links_downloads_that_exist(site, example):
    page = soup(site.page(example))
    links = {
        a["href"].rsplit(".", 1)[-1]: a["href"]
        for a in page.select("div.sphx-glr-download a[href]")
    }
    assert {"py", "ipynb"} <= set(links), f"{example}: download links {links}"
    for kind in ("py", "ipynb"):
        target = (site.page(example).parent / links[kind]).resolve()
        assert target.is_file() and target.name == f"{example.stem}.{kind}", target
        assert target.stat().st_size > 1000


def test_every_notebook_validates_against_the_format(site):
    notebooks = sorted((site.html / "_downloads").rglob("*.ipynb"))
    assert sorted(nb.stem for nb in notebooks) == sorted(e.stem for e in EXAMPLES)
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        first_code = next(cell for cell in notebook.cells if cell.cell_type == "code")
        assert "%pip install torch==" in first_code.source, (
            f"{path.name}: no install cell"
        )


def test_execution_times_page_lists_every_example(site):
    page = soup(site.html / "sg_execution_times.html")
    table_text = " ".join(td.get_text() for td in page.select("table td"))
    for example in EXAMPLES:
        assert example.name in table_text, (
            f"{example} missing from the execution-times table"
        )
    assert re.search(r"total execution time for \d+ files", page.get_text())


def test_index_leads_into_the_gallery_and_explains_the_timings(site):
    links = {a["href"] for a in soup(site.html / "index.html").select("a[href]")}
    assert "auto_examples/index.html" in links
    assert "reading-timings.html" in links
    for example in EXAMPLES:
        assert f"auto_examples/{example.with_suffix('.html')}" in links


def test_no_page_loads_anything_from_another_host(site):
    for path in site.html.rglob("*.html"):
        page = soup(path)
        for tag, attribute in [
            ("script", "src"),
            ("link", "href"),
            ("img", "src"),
            ("iframe", "src"),
        ]:
            for element in page.find_all(tag):
                url = element.get(attribute, "")
                assert not re.match(r"(https?:)?//", url), f"{path.name} loads {url}"


def test_a_broken_example_fails_the_build_and_is_named(tmp_path):
    tree = copy_sources(tmp_path)
    source = (tree / "examples" / "plot_batch_jacobians_hessians.py").read_text()
    correct = "reference_jacobians = (1 - outputs**2)[:, :, None] * weight"
    assert correct in source
    broken = source.replace(
        correct, "reference_jacobians = (1 + outputs**2)[:, :, None] * weight"
    )
    (tree / "examples" / "plot_broken_copy.py").write_text(broken)
    result = make(tree, "html", "EXAMPLE=plot_broken_copy")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "plot_broken_copy.py" in log
    assert "AssertionError" in log
    assert "Built the site" not in log


def test_a_sphinx_warning_fails_the_build_every_time(tmp_path):
    tree = copy_sources(tmp_path)
    with (tree / "docs" / "index.rst").open("a") as index:
        index.write("\nSee :doc:`a_page_that_does_not_exist`.\n")
    for attempt in ("first build", "rebuild with nothing changed"):
        result = make(tree, "html-noplot")
        log = result.stdout + result.stderr
        assert result.returncode != 0, f"{attempt} succeeded:\n{log[-3000:]}"
        assert "index.rst" in log and "a_page_that_does_not_exist" in log, (
            f"{attempt}:\n{log[-3000:]}"
        )
        assert "Built the site" not in log


def test_examples_tests_and_docs_pass_the_linter():
    result = make(REPO, "lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_examples_do_not_leak_global_state_into_each_other(tmp_path):
    """The reset before each example restores torch's settings, the seeds and matplotlib."""
    tree = copy_sources(tmp_path)
    (tree / "examples" / "plot_zz_leak_a.py").write_text(
        '"""\nLeaks state\n===========\n"""\n'
        "import matplotlib\nimport matplotlib.pyplot as plt\nimport torch\n\n"
        "torch.set_default_dtype(torch.float64)\ntorch.set_grad_enabled(False)\n"
        "torch.set_num_threads(1)\ntorch.manual_seed(1234)\n"
        'matplotlib.rcParams["lines.linewidth"] = 9.0\nplt.plot([0, 1])\nplt.show()\n'
    )
    (tree / "examples" / "plot_zz_leak_b.py").write_text(
        '"""\nFinds a fresh start\n===================\n"""\n'
        "import matplotlib\nimport matplotlib.pyplot as plt\nimport torch\n\n"
        "assert torch.get_default_dtype() == torch.float32\n"
        "assert torch.is_grad_enabled()\n"
        f"assert torch.get_num_threads() == {torch.get_num_threads()}\n"
        "first_draw = torch.rand(3)\n"
        "torch.manual_seed(0)\nassert torch.equal(first_draw, torch.rand(3))\n"
        'assert matplotlib.rcParams["lines.linewidth"] == 1.5\n'
        "assert not plt.get_fignums()\nplt.plot([0, 1])\nplt.show()\n"
    )
    result = make(tree, "html", "EXAMPLE=plot_zz_leak")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "executed 2 out of 2 files" in log


def test_gallery_lists_examples_in_the_index_pages_reading_order(site):
    index_order = re.findall(
        r"auto_examples/(plot_\w+)\.html", (site.html / "index.html").read_text()
    )
    index_order = list(dict.fromkeys(index_order))
    gallery = soup(site.html / "auto_examples" / "index.html")
    gallery_order = [
        a["href"].removesuffix(".html")
        for a in gallery.select("div.sphx-glr-thumbcontainer a")
    ]
    assert gallery_order == index_order
    assert sorted(gallery_order) == sorted(e.stem for e in EXAMPLES)


def test_api_names_in_the_prose_link_to_the_pytorch_reference(site):
    pages = [site.html / "index.html", *(site.page(example) for example in EXAMPLES)]
    linked = 0
    for path in pages:
        for name in soup(path).select("code.xref.py"):
            link = name.find_parent("a")
            assert link is not None, f"{path.name}: {name.get_text()} links nowhere"
            assert link["href"].startswith("https://docs.pytorch.org/docs/stable/"), (
                link["href"]
            )
            linked += 1
    assert linked >= 10
