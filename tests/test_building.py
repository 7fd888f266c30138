"""What `make html` produces, and how it fails."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import yaml
from helpers import (
    EXAMPLES,
    MINIMAL_INDEX,
    REPO,
    copy_sources,
    example_path,
    make,
    shard_of,
    small_site,
    soup,
)


def test_make_html_says_where_to_open_the_site(site):
    assert (site.html / "index.html").is_file()
    if site.merged:  # every example ran in a shard, none in the merge
        assert "Built the site from the shards, running no example: open " in site.log
        assert "executed 0 out of 0 files" in site.log
        assert (
            f"excluding {len(EXAMPLES)} files that had previously been run" in site.log
        )
    else:
        assert "Built the site: open " in site.log
        assert f"executed {len(EXAMPLES)} out of {len(EXAMPLES)} files" in site.log


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example_page_shows_its_run(site, example):
    page = soup(site.page(example))
    outputs = page.select("div.sphx-glr-script-out pre")
    assert outputs, f"{example}: no printed output on the page"
    first_output = outputs[0].get_text()
    assert re.search(
        r"torch \d+\.\d+\.\d+\S* on (cpu|cuda\S*), \d+ threads", first_output
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


def test_every_notebook_validates_against_the_format(site):
    notebooks = sorted((site.html / "_downloads").rglob("*.ipynb"))
    assert sorted(nb.stem for nb in notebooks) == sorted(e.stem for e in EXAMPLES)
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        first_code = next(cell for cell in notebook.cells if cell.cell_type == "code")
        assert '"torch": "torch==' in first_code.source, f"{path.name}: no install cell"
        assert "%pip install" in first_code.source, f"{path.name}: no install cell"


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
    tree = small_site(tmp_path, examples=())
    batch_page = example_path("plot_batch_jacobians_hessians.py")
    source = (REPO / "examples" / batch_page).read_text()
    correct = "reference_jacobians = (1 - outputs64**2)[:, :, None] * weight64"
    assert correct in source
    broken = source.replace(
        correct, "reference_jacobians = (1 + outputs64**2)[:, :, None] * weight64"
    )
    (tree / "examples" / batch_page.parent / "plot_broken_copy.py").write_text(broken)
    result = make(tree, "html", "EXAMPLE=plot_broken_copy")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "plot_broken_copy.py" in log
    assert "AssertionError" in log
    assert "Built the site" not in log


def test_a_sphinx_warning_fails_the_build_every_time(tmp_path):
    tree = small_site(tmp_path)
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
    """The reset before each example restores torch's settings, the seeds, matplotlib,
    torch.compile's caches, and a heap without the last example's freed memory."""
    tree = copy_sources(tmp_path, examples=set())
    (tree / "docs" / "index.rst").write_text(MINIMAL_INDEX)
    (tree / "examples" / "guides" / "plot_zz_leak_a.py").write_text(
        '"""\nLeaks state\n===========\n"""\n'
        "import matplotlib\nimport matplotlib.pyplot as plt\nimport torch\n\n"
        "torch.set_default_dtype(torch.float64)\ntorch.set_grad_enabled(False)\n"
        "torch.set_num_threads(1)\ntorch.manual_seed(1234)\n"
        'matplotlib.rcParams["lines.linewidth"] = 9.0\nplt.plot([0, 1])\nplt.show()\n'
        # Keep freed memory, as every example does, then allocate and free 512 MiB.
        "import ctypes, os, re\nlibc = ctypes.CDLL(None)\n"
        "libc.mallopt(-4, 0)\nlibc.mallopt(-1, -1)\n"
        "big = torch.ones(2**27)\ndel big\n"
        # A vmap'd function compiled at two batch sizes: dynamo now treats that dimension as
        # dynamic for every vmap'd function, since they share one code object.
        "from torch.func import vmap\n"
        "seen_twice = torch.compile(vmap(torch.sin), backend='eager')\n"
        "seen_twice(torch.ones(2, 4))\nseen_twice(torch.ones(5, 4))\n"
        "status = open('/proc/self/status').read()\n"
        "os.environ['RESIDENT_KIB'] = re.search(r'VmRSS:\\s+(\\d+)', status).group(1)\n"
    )
    (tree / "examples" / "guides" / "plot_zz_leak_b.py").write_text(
        '"""\nFinds a fresh start\n===================\n"""\n'
        "import matplotlib\nimport matplotlib.pyplot as plt\nimport torch\n"
        "from torch.func import vmap\n\n"
        "assert torch.get_default_dtype() == torch.float32\n"
        "assert torch.is_grad_enabled()\n"
        f"assert torch.get_num_threads() == {torch.get_num_threads()}\n"
        "first_draw = torch.rand(3)\n"
        "torch.manual_seed(0)\nassert torch.equal(first_draw, torch.rand(3))\n"
        'assert matplotlib.rcParams["lines.linewidth"] == 1.5\n'
        "assert not plt.get_fignums()\nplt.plot(vmap(torch.sin)(torch.zeros(2)))\n"
        "plt.show()\n"
        # A fresh process compiles its first vmap'd function for the shape it sees (a graph
        # whose inputs hold no symbolic size), not for a dimension an earlier example varied.
        "graph_inputs = []\n"
        "def recording(graph, example_inputs):\n"
        "    graph_inputs.extend(type(x).__name__ for x in example_inputs)\n"
        "    return graph.forward\n"
        "torch.compile(vmap(torch.cos), backend=recording)(torch.ones(3, 4))\n"
        "assert graph_inputs == ['Tensor'], graph_inputs\n"
        # The heap that the last example kept went back to the kernel before this one.
        "import os, re\nstatus = open('/proc/self/status').read()\n"
        "resident = int(re.search(r'VmRSS:\\s+(\\d+)', status).group(1))\n"
        "assert int(os.environ['RESIDENT_KIB']) - resident > 400 * 1024, resident\n"
    )
    result = make(tree, "html")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert "executed 2 out of 2 files" in log


def test_gallery_lists_examples_in_the_index_pages_reading_order(site):
    index_order = re.findall(
        r"auto_examples/(?:\w+/)*(plot_\w+)\.html",
        (site.html / "index.html").read_text(),
    )
    index_order = list(dict.fromkeys(index_order))
    gallery = soup(site.html / "auto_examples" / "index.html")
    gallery_order = [
        Path(a["href"]).stem for a in gallery.select("div.sphx-glr-thumbcontainer a")
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


def run_mutated_example(tmp_path, example, anchor, replacement):
    """Run an example, with `anchor` replaced, as a plain script; return the result."""
    source = (REPO / "examples" / example_path(example)).read_text(encoding="utf-8")
    assert source.count(anchor) == 1, f"{example} no longer contains {anchor!r}"
    script = tmp_path / example
    script.write_text(source.replace(anchor, replacement), encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_wrong_gradient_of_one_small_parameter_fails_its_check(tmp_path):
    """conv1.bias is under 1% of the gradient's norm: a per-parameter check names it."""
    anchor = "float32_errors = check_each_parameter("
    result = run_mutated_example(
        tmp_path,
        "plot_per_sample_grads.py",
        anchor,
        'per_sample_grads["conv1.bias"] = torch.zeros_like(per_sample_grads["conv1.bias"])\n'
        + anchor,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "AssertionError: vmap(grad), float32: conv1.bias" in result.stderr


def test_a_recipe_changed_on_the_jax_side_fails_the_comparison(tmp_path):
    """The JAX classifier without its last bias: the first recipe checked no longer agrees."""
    result = run_mutated_example(
        tmp_path,
        "plot_torch_func_and_jax.py",
        'return hidden @ p["4.weight"].T + p["4.bias"]',
        'return hidden @ p["4.weight"].T',
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "AssertionError: per-sample gradients, " in result.stderr
    assert "JAX and torch.func differ by" in result.stderr


def test_a_typo_does_not_pass_for_an_error_that_vmap_raises(tmp_path):
    result = run_mutated_example(
        tmp_path,
        "plot_pitfalls.py",
        "vmap(lambda x: x.sum().item())",
        "vmap(lambda x: x.sum().itme())",
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "AttributeError" in result.stderr and "itme" in result.stderr


def test_reproduce_needs_a_built_site(tmp_path):
    result = make(copy_sources(tmp_path), "reproduce")
    assert result.returncode != 0
    assert "run `make html` first" in result.stderr


def test_reproduce_names_the_examples_when_given_an_unknown_one(site):
    result = make(site.tree, "reproduce", "EXAMPLE=plot_does_not_exist")
    assert result.returncode != 0
    assert "plot_does_not_exist" in result.stderr
    for example in EXAMPLES:
        assert example.stem in result.stderr


def test_reproduce_puts_each_ratio_of_a_page_beside_its_fresh_runs(site):
    example = "plot_batch_jacobians_hessians"
    result = make(site.tree, "reproduce", f"EXAMPLE={example}", "RUNS=1")
    assert result.returncode == 0, result.stderr[-3000:]
    page = site.page(example_path(f"{example}.py")).read_text()
    page_ratios = re.findall(r"(\d+\.\d+)x faster than the loop", page)
    assert len(page_ratios) == 4  # sum trick, vmap, vmap(jacfwd); vmap for Hessians
    rows = [
        line for line in result.stdout.splitlines() if "faster than the loop" in line
    ]
    assert [row.split()[0] for row in rows] == page_ratios, result.stdout
    assert re.search(r"\d+ ratios, \d+ within ±25%", result.stdout)
    # Before its run, how fast one thread runs a matrix product (a shared core is slower),
    # and how much all threads speed it up: whether cores were free.
    assert re.search(
        r"one thread.*GFLOP/s just before each run: \d+\.\d\n", result.stdout
    )
    assert re.search(
        r"all threads against one, matrix.*before each run: \d+\.\d\dx\n", result.stdout
    )
    # The same for a large write, which memory bandwidth limits.
    assert re.search(
        r"all threads against one, writing.*before each run: \d+\.\d\dx\n",
        result.stdout,
    )
    # The machine's own ratio of per-call overhead to arithmetic, which a loop-against-batch
    # ratio inherits, with its spread over the runs, and how many examples it moved for.
    assert re.search(
        r"machine's own ratio, 100 small .*before each run: \d+\.\d\d \(spread 0%\)\n",
        result.stdout,
    )
    assert re.search(
        r"the machine's own ratio moved by more than ±25% over the runs of 0 of 1 examples",
        result.stdout,
    )
    # And what share of the CPU time the host took during it (on Linux, always readable).
    assert re.search(r"\(steal\) during each run: \d+\.\d%\n", result.stdout)


def test_the_timings_page_opens_with_the_reports_bottom_line_and_links_them(site):
    """The counts on the page are the reports' own, and each report is one click away."""
    page = soup(site.html / "reading-timings.html")
    text = " ".join(page.get_text().split())
    cpu = (REPO / "docs" / "measured" / "reproduce-report.txt").read_text()
    assert re.match(
        r"make reproduce: \d+ fresh runs of each .*, \d{4}-\d\d-\d\d\n", cpu
    )
    total, within = re.search(r"\n(\d+) ratios, (\d+) within ±25%", cpu).groups()
    first_section = page.select("article section section")[0]
    assert first_section.find("h2").get_text().startswith("How far to trust a ratio")
    assert f"({within} of {total})" in " ".join(first_section.get_text().split())
    gpu = (REPO / "docs" / "measured" / "gpu-report.txt").read_text()
    assert "NVIDIA H100" in gpu.splitlines()[0] and "torch 2.11.0+cu130" in gpu[:300]
    ratio_rows = re.findall(r"^ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +\d+% .*$", gpu, re.M)
    steady = [row for row in ratio_rows if "<--" not in row]
    assert f"{len(steady)} of {len(ratio_rows)} ratios" in text
    links = {a["href"].rsplit("/", 1)[-1] for a in page.select("a.download")}
    assert {"reproduce-report.txt", "gpu-report.txt"} <= links
    for name in links & {"reproduce-report.txt", "gpu-report.txt"}:
        assert list((site.html / "_downloads").rglob(name)), name
    assert "rule" not in text and "development machine" not in text


# The front door: bad input fails at once, with one line saying what to do.


@pytest.mark.parametrize("name", ["plot_does_not_exist", "plot_per_sample"])
def test_make_html_refuses_an_example_name_that_is_not_exactly_one(site, name):
    result = make(site.tree, "html", f"EXAMPLE={name}")
    assert result.returncode != 0
    assert f"no example called '{name}'" in result.stderr
    for example in EXAMPLES:
        assert example.stem in result.stderr
    assert "Built the site" not in result.stdout


def front_door(tree, *args, **env):
    """`make` as a new user runs it: the tree's own .venv, no overrides from the tests."""
    return subprocess.run(
        ["make", "-C", str(tree), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_a_python_that_is_too_old_is_named(tmp_path):
    tree = copy_sources(tmp_path / "tree")
    old_python = tmp_path / "python3.9"
    old_python.write_text(
        "#!/bin/sh\nexit 1\n"
    )  # fails the version check, like 3.9 does
    old_python.chmod(0o755)
    result = front_door(tree, "venv", f"PYTHON={old_python}")
    assert result.returncode != 0
    assert "is not Python 3.11 or newer; run: make PYTHON=python3.11" in result.stderr
    assert not (tree / ".venv").exists()


def test_a_stale_venv_is_named_instead_of_used(tmp_path):
    tree = copy_sources(tmp_path)
    stamp = tree / ".venv" / ".installed"
    stamp.parent.mkdir()
    stamp.touch()  # newer than requirements.txt, but there is no interpreter behind it
    result = front_door(tree, "html")
    assert result.returncode != 0
    assert (
        ".venv is stale or broken" in result.stderr and "rm -rf .venv" in result.stderr
    )


def test_the_tests_name_a_missing_browser(tmp_path):
    result = make(copy_sources(tmp_path), "test", "CHROMIUM=/nonexistent/chromium")
    assert result.returncode != 0
    assert "no browser '/nonexistent/chromium'" in result.stderr
    assert "apt-get install chromium" in result.stderr


def test_serve_before_a_build_says_to_build_first(tmp_path):
    result = make(copy_sources(tmp_path), "serve")
    assert result.returncode != 0
    assert "nothing to serve" in result.stderr and "make html first" in result.stderr


def test_a_misspelt_api_name_fails_the_build_naming_the_page(tmp_path):
    tree = small_site(tmp_path)
    with (tree / "docs" / "reading-timings.rst").open("a") as page:
        page.write("\nSee :func:`torch.func.vmapp`.\n")
    result = make(tree, "html-noplot")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "reading-timings.rst" in log and "torch.func.vmapp" in log


# Links from API names, and the API page.


def test_api_names_in_the_code_link_to_the_pytorch_reference(site):
    pages = [soup(site.page(example)) for example in EXAMPLES]
    linked = {
        a.get_text(): a["href"]
        for page in pages
        for a in page.select("div.highlight-Python pre a[href]")
    }
    expected = {  # torch.func.vmap is torch.vmap, which PyTorch documents under that name
        "vmap": "generated/torch.vmap.html#torch.vmap",
        "functional_call": "generated/torch.func.functional_call.html",
        "F.cross_entropy": "generated/torch.nn.functional.cross_entropy.html",
        "benchmark.Timer": "benchmark_utils.html#torch.utils.benchmark.Timer",
    }
    for name, target in expected.items():
        assert name in linked, f"{name} is not linked in any code block"
        assert linked[name].startswith("https://docs.pytorch.org/docs/stable/")
        assert target in linked[name], linked[name]


def api_sections(site):
    """The API page's sections, by the function name in their heading."""
    page = soup(site.html / "api.html")
    return {s.h2.get_text().strip("#¶ "): s for s in page.select("section") if s.h2}


def test_the_api_page_lists_each_torch_func_function_with_its_examples(site):
    sections = api_sections(site)
    for name in [
        "vmap",
        "grad",
        "jacrev",
        "jacfwd",
        "hessian",
        "vjp",
        "functional_call",
    ]:
        assert name in sections, f"{name} missing from the API page: {sorted(sections)}"
        section = sections[name]
        reference = section.select_one("a.reference.external[href]")
        assert reference["href"].startswith(
            "https://docs.pytorch.org/docs/stable/generated/"
        )
        assert (
            f"torch.func.{name}" in reference["href"]
            or f"torch.{name}" in reference["href"]
        )
        thumbnails = section.select("div.sphx-glr-thumbcontainer a[href]")
        assert thumbnails, f"{name}: no mini-gallery"
        for link in thumbnails:
            assert (site.html / link["href"]).is_file(), link["href"]
    source_uses = {
        name
        for name in sections
        if any(name in (REPO / "examples" / e).read_text() for e in EXAMPLES)
    }
    assert source_uses == set(sections)


# Debugging helpers of torch.func that no page needs to teach.
DEBUG_HELPERS = {"debug_unwrap"}


def test_every_torch_func_function_has_an_example_on_the_api_page(site):
    """Every public torch.func function of the pinned torch is used by an executed example."""
    sections = api_sections(site)
    covered = {
        name
        for name, section in sections.items()
        if section.select("div.sphx-glr-thumbcontainer")
    }
    missing = sorted(set(torch.func.__all__) - DEBUG_HELPERS - covered)
    assert not missing, f"torch.func functions no example uses: {missing}"


def test_every_example_is_built_and_its_notebook_run_by_the_suite(site, request):
    """An example the suite would not build and run (a new folder, a narrowed list) fails."""
    on_disk = sorted(
        p.relative_to(REPO / "examples") for p in (REPO / "examples").rglob("plot_*.py")
    )
    for example in on_disk:
        assert site.page(example).is_file(), f"{example}: no page was built"
    notebook_runs = {
        item.callspec.params["example"]
        for item in request.session.items
        if item.originalname == "test_notebook_runs_top_to_bottom_in_a_fresh_kernel"
    }
    if os.environ.get("NOTEBOOK_SHARDS"):  # CI's shard jobs ran them (make test-shard)
        count = int(os.environ["NOTEBOOK_SHARDS"])
        workflow = yaml.safe_load(
            (REPO / ".github/workflows/pull-request.yml").read_text()
        )
        assert workflow["jobs"]["shard"]["strategy"]["matrix"]["shard"] == list(
            range(1, count + 1)
        ), f"pull-request.yml does not run the notebooks of {count} shards"
        notebook_runs = {
            example
            for index in range(1, count + 1)
            for example in shard_of(EXAMPLES, f"{index}/{count}")
        }
    not_run = [str(e) for e in on_disk if e not in notebook_runs]
    assert not not_run, f"examples whose notebook the suite does not run: {not_run}"


def test_a_misspelling_or_broken_markup_fails_lint_naming_the_file(tmp_path):
    tree = copy_sources(tmp_path)
    for name in ["README.md", "ruff.toml"]:
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(
        REPO / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__")
    )
    example = tree / "examples" / example_path("plot_pitfalls.py")
    clean = example.read_text(encoding="utf-8")
    planted = clean.replace("# Two helpers", "# Two helpers we recieve", 1)
    example.write_text(planted, encoding="utf-8")
    result = make(tree, "lint")
    assert result.returncode != 0
    assert "plot_pitfalls.py:" in result.stdout and "recieve" in result.stdout
    example.write_text(clean, encoding="utf-8")
    index = tree / "docs" / "index.rst"
    index.write_text(index.read_text(encoding="utf-8") + "\nSee :func:vmap for more.\n")
    result = make(tree, "lint")
    assert result.returncode != 0
    assert "index.rst" in result.stdout + result.stderr
    assert "role-without-backticks" in result.stdout + result.stderr


MACHINE_READ_LINES = {
    "plot_per_sample_grads_at_the_limit.py": (
        r"best exact method at batch (\d+): ([\w -]+), (\d+\.\d\d) x the floor",
        3,  # one per batch size of the MLP (16, 64, 256 on a CPU; three on a GPU)
    ),
    "plot_hessian_vector_products.py": (
        r"hvp ([\w() -]+): (\d+\.\d\d) x one gradient",
        4,  # three methods eager, and at least the best one compiled
    ),
    "plot_torch_func_and_jax.py": (
        r"([\w() +-]+): torch eager [\d.]+ ms, torch compiled [\d.]+ ms, JAX [\d.]+ ms, "
        r"JAX jit ([\d.]+) ms \(IQR [\d., ]+ ms\)",
        7,  # x + 1, then per-sample gradients, two Jacobians, Hessian, HVP, ensemble
    ),
}


@pytest.mark.parametrize("example", sorted(MACHINE_READ_LINES), ids=str)
def test_the_lines_read_by_machine_are_on_the_page_in_their_fixed_form(site, example):
    pattern, at_least = MACHINE_READ_LINES[example]
    output = "\n".join(
        pre.get_text()
        for pre in soup(site.page(example_path(example))).select(
            "div.sphx-glr-script-out pre"
        )
    )
    lines = [line for line in output.splitlines() if re.fullmatch(pattern, line)]
    assert len(lines) >= at_least, (
        f"{example}: {len(lines)} lines of the form {pattern}"
    )
    for line in lines:
        assert float(re.fullmatch(pattern, line).groups()[-1]) > 0, line


def test_torch_index_reaches_pip_only_when_asked(tmp_path):
    """TORCH_INDEX adds PyTorch's CPU index to the install; without it, pip uses its own."""
    tree = copy_sources(tmp_path)
    cpu_index = "https://download.pytorch.org/whl/cpu"
    asked = make(tree, "-n", "-B", "venv", f"TORCH_INDEX={cpu_index}").stdout
    (install,) = [line for line in asked.splitlines() if "-r requirements.txt" in line]
    assert f"--extra-index-url {cpu_index} -r requirements.txt" in install
    default = make(tree, "-n", "-B", "venv").stdout
    (install,) = [
        line for line in default.splitlines() if "-r requirements.txt" in line
    ]
    assert "--extra-index-url" not in install and "--index-url" not in install


# The gallery's sections, in reading order: the folders of examples/ and their READMEs' titles.
SECTIONS = {
    "start_here": "Start here",
    "per_sample_gradients": "Per-sample gradients and privacy",
    "jacobians_and_curvature": "Jacobians, Hessians and curvature",
    "models_as_functions": "Models as functions: ensembles, meta-learning and the NTK",
    "science": "Derivatives for science: forces, Laplacians, PDEs and solvers",
    "guides": "Guides",
}


def in_reading_order(titles, texts):
    positions = [texts.index(title) for title in titles if title in texts]
    return len(positions) == len(titles) and positions == sorted(positions)


def test_gallery_sidebar_and_index_show_the_sections_in_reading_order(site):
    titles = list(SECTIONS.values())
    gallery = soup(site.html / "auto_examples" / "index.html")
    sections = gallery.select("article section section")
    headings = [s.find("h2").get_text().strip("¶ ") for s in sections]
    assert headings == titles
    for folder, section in zip(SECTIONS, sections):
        shown = {
            Path(a["href"]).stem
            for a in section.select("div.sphx-glr-thumbcontainer a")
        }
        assert shown == {e.stem for e in EXAMPLES if e.parent.name == folder}, folder
    sidebar = [a.get_text(" ", strip=True) for a in gallery.select(".sidebar-tree a")]
    assert in_reading_order(titles, sidebar), sidebar
    landing = soup(site.html / "index.html")
    landing_headings = [h.get_text().strip("¶ ") for h in landing.select("h3")]
    assert in_reading_order(titles, landing_headings), landing_headings
    assert sorted(SECTIONS) == sorted({e.parent.name for e in EXAMPLES})
