"""The site's Sphinx extensions (docs/sphinxext) and tools, on small inputs: seconds, no build."""

import importlib.util
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from docutils import nodes
from docutils.frontend import get_default_settings
from docutils.parsers.rst import Parser
from docutils.utils import new_document
from helpers import REPO
from sphinx import addnodes
from sphinx.errors import ExtensionError

sys.path[:0] = [str(REPO / "docs" / "sphinxext"), str(REPO / "tools")]

import api_reference  # noqa: E402
import cuda_peak_memory  # noqa: E402
import example_buttons  # noqa: E402
import gallery_shards  # noqa: E402
import not_found_links  # noqa: E402
import notebook_install_cell  # noqa: E402
import offline_assets  # noqa: E402
import reading_order  # noqa: E402
import reproduce  # noqa: E402
import reset_between_examples  # noqa: E402
import thumbnail_alt_text  # noqa: E402


def test_reading_order_follows_the_index_and_puts_unlisted_examples_last():
    index = (
        "\n:doc:`auto_examples/section_one/plot_b`\n"
        ":doc:`auto_examples/section_two/plot_a`\n:doc:`auto_examples/index`\n"
    )
    assert reading_order.listed_examples(index) == ["plot_b", "plot_a"]
    key = reading_order.ReadingOrder("examples")
    key.order = ["plot_b", "plot_a"]
    files = ["plot_a.py", "plot_c.py", "plot_b.py", "plot_0.py"]
    assert sorted(files, key=key) == [
        "plot_b.py",
        "plot_a.py",
        "plot_0.py",
        "plot_c.py",
    ]
    assert repr(key) == "ReadingOrder"  # stable, so Sphinx sees an unchanged config


def test_install_cell_pins_what_requirements_pin_and_names_what_is_missing():
    text = "torch==2.13.0\nMatplotlib==3.11.2\n"
    assert notebook_install_cell.pinned_version("torch", text) == "2.13.0"
    assert notebook_install_cell.pinned_version("matplotlib", text) == "3.11.2"
    with pytest.raises(ValueError, match="pins no version of opacus"):
        notebook_install_cell.pinned_version("opacus", text)
    cell = notebook_install_cell.install_cell()
    assert '"torch": "torch==2.13.0"' in cell and '"matplotlib": "matplotlib==' in cell
    assert "%pip install" in cell


def test_install_cell_names_what_an_example_imports_by_its_pip_name():
    source = (
        "import os\nimport torch.nn.functional as F\nfrom sklearn.datasets import x\n"
        "from opacus import GradSampleModule\nimport matplotlib.pyplot as plt\n"
        "from . import local\n"
    )
    assert notebook_install_cell.needed_packages(source) == (
        ("matplotlib", "matplotlib"),
        ("opacus", "opacus"),
        ("sklearn", "scikit-learn"),
        ("torch", "torch"),
    )


def example_doctree(with_python_download=True):
    """A doctree shaped like a sphinx-gallery example page, with its download footer."""
    document = new_document("example", get_default_settings(Parser))
    section = nodes.section()
    section += nodes.title(text="An example")
    section += nodes.paragraph(text="What you will learn.")
    footer = nodes.container(classes=["sphx-glr-footer", "sphx-glr-footer-example"])
    downloads = [("jupyter", "plot_x.ipynb")]
    if with_python_download:
        downloads.append(("python", "plot_x.py"))
    for kind, target in downloads:
        box = nodes.container(
            classes=["sphx-glr-download", f"sphx-glr-download-{kind}"]
        )
        link = addnodes.download_reference(reftarget=target, filename=f"0a1b/{target}")
        link += nodes.literal(text=f"Download {target}")
        box += nodes.paragraph("", "", link)
        footer += box
    section += footer
    document += section
    return document


def fake_app(repository):
    config = SimpleNamespace(
        colab_notebooks={"repository": repository, "branch": "gh-pages"}
    )
    return SimpleNamespace(config=config)


def test_buttons_go_right_under_the_title_with_colab_first():
    doctree = example_doctree()
    example_buttons.add_buttons(fake_app("owner/repo"), doctree, "auto_examples/plot_x")
    section = next(iter(doctree.findall(nodes.section)))
    buttons = section[1]
    assert "example-buttons" in buttons["classes"]
    colab = next(iter(buttons.findall(nodes.reference)))
    assert colab.astext() == "Run in Google Colab"
    assert colab["refuri"] == (
        "https://colab.research.google.com/github/owner/repo/blob/gh-pages"
        "/_downloads/0a1b/plot_x.ipynb"
    )
    downloads = list(buttons.findall(addnodes.download_reference))
    assert [d.astext() for d in downloads] == [
        "Download notebook",
        "Download Python source",
    ]
    assert [d["filename"] for d in downloads] == ["0a1b/plot_x.ipynb", "0a1b/plot_x.py"]


def test_without_a_repository_there_is_no_colab_button():
    doctree = example_doctree()
    example_buttons.add_buttons(fake_app(""), doctree, "auto_examples/plot_x")
    buttons = next(iter(doctree.findall(nodes.section)))[1]
    assert "Colab" not in buttons.astext()


def test_a_changed_download_footer_fails_loudly_naming_the_page():
    with pytest.raises(ExtensionError, match="auto_examples/plot_x: sphinx-gallery"):
        example_buttons.add_buttons(
            fake_app(""),
            example_doctree(with_python_download=False),
            "auto_examples/plot_x",
        )


def test_pages_that_are_not_examples_get_no_buttons():
    document = new_document("index", get_default_settings(Parser))
    document += nodes.section("", nodes.title(text="Index"))
    example_buttons.add_buttons(fake_app("owner/repo"), document, "index")
    assert "example-buttons" not in document.pformat()


def test_a_thumbnail_takes_the_alt_text_of_its_examples_first_figure():
    example = new_document("example", get_default_settings(Parser))
    example += nodes.image(uri="a.png", alt="", classes=["other"])
    example += nodes.image(
        uri="b.png", alt="Bars of time", classes=["sphx-glr-single-img"]
    )
    example += nodes.image(uri="c.png", alt="Later", classes=["sphx-glr-single-img"])
    assert thumbnail_alt_text.first_figure_alt(example) == "Bars of time"

    gallery = new_document("gallery", get_default_settings(Parser))
    thumb = nodes.image(
        uri="auto_examples/images/thumb/sphx_glr_plot_x_thumb.png", alt=""
    )
    missing = nodes.image(uri="auto_examples/images/thumb/sphx_glr_plot_y_thumb.png")
    gallery += [thumb, missing]
    env = SimpleNamespace(
        found_docs={"auto_examples/plot_x"}, get_doctree=lambda name: example
    )
    thumbnail_alt_text.describe_thumbnails(
        SimpleNamespace(env=env), gallery, "auto_examples/index"
    )
    assert thumb["alt"] == "Bars of time"
    assert missing["alt"] == thumbnail_alt_text.NOT_RUN


def test_execution_times_pages_lose_their_cdn_scripts_and_keep_the_table():
    doctree = new_document("times", get_default_settings(Parser))
    doctree += nodes.raw("", '<script src="https://cdn.example/jquery.js"></script>')
    doctree += nodes.table()
    app = SimpleNamespace(env=SimpleNamespace(docname="sg_execution_times"))
    offline_assets.drop_cdn_assets(app, doctree)
    assert not list(doctree.findall(nodes.raw)) and list(doctree.findall(nodes.table))

    other = new_document("other", get_default_settings(Parser))
    other += nodes.raw("", "<b>kept</b>")
    offline_assets.drop_cdn_assets(
        SimpleNamespace(env=SimpleNamespace(docname="x")), other
    )
    assert list(other.findall(nodes.raw))


def test_the_api_page_lists_only_the_functions_that_examples_use(tmp_path):
    (tmp_path / "torch.vmap.examples").write_text(".. thumbnails of examples\n")
    (tmp_path / "torch.func.jacrev.examples").write_text(".. thumbnails\n")
    (tmp_path / "torch.func.grad.examples").write_text("")  # recorded, but no example
    (tmp_path / "torch.func.not_a_function.examples").write_text("x\n")
    assert api_reference.used_functions(tmp_path) == {
        "jacrev": ["torch.func.jacrev"],
        "vmap": ["torch.vmap"],
    }
    assert api_reference.summary("vmap") == api_reference.DESCRIPTIONS["vmap"]
    assert ":" not in api_reference.summary("linearize").split("``")[0]


def test_reproduce_matches_a_ratio_across_runs_whatever_the_timings_printed():
    page = (
        "B=   8: loop     8.23 ms, vmap    0.86 ms -> 9.55x faster\nall 1.5x of 2.0x\n"
        "hvp jvp: 2.50 x one gradient\ntarget (within 2.00x of the floor): met\n"
    )
    fresh = (
        "B=   8: loop    18.23 ms, vmap   10.86 ms -> 1.68x faster\nall 1.4x of 2.1x\n"
        "hvp jvp: 2.75 x one gradient\ntarget (within 2.00x of the floor): missed\n"
    )
    on_page, in_run = reproduce.ratios(page), reproduce.ratios(fresh)
    assert set(on_page) == set(in_run) and len(on_page) == 5
    assert sorted(v for v, _ in in_run.values()) == [1.4, 1.68, 2.0, 2.1, 2.75]
    first = next(iter(on_page.values()))
    assert first == (9.55, "B=   8: loop     8.23 ms, vmap    0.86 ms -> □x faster")
    assert (2.5, "hvp jvp: □ x one gradient") in on_page.values()


def test_reproduce_reads_the_hosts_share_of_cpu_time_from_the_counters():
    # /proc/stat order: user nice system idle iowait irq softirq steal guest guest_nice
    before = [100, 0, 20, 500, 0, 0, 0, 10, 0, 0]
    after = [160, 0, 30, 520, 0, 0, 0, 20, 0, 0]
    assert reproduce.steal_share(before, after) == 10 / 100
    assert reproduce.steal_share(None, after) is None
    assert len(reproduce.cpu_times() or [0] * 8) >= 8


def test_the_404_pages_own_links_start_at_the_sites_root():
    doctree = new_document("404", get_default_settings(Parser))
    inside = nodes.reference(refuri="auto_examples/index.html", internal=True)
    anchor = nodes.reference(refuri="#top", internal=True)
    outside = nodes.reference(refuri="https://pytorch.org/", internal=False)
    doctree += nodes.paragraph("", "", inside, anchor, outside)
    config = SimpleNamespace(notfound_pagename="404", notfound_urls_prefix="/site/")
    not_found_links.absolute_links(SimpleNamespace(config=config), doctree, "404")
    assert inside["refuri"] == "/site/auto_examples/index.html"
    assert anchor["refuri"] == "#top" and outside["refuri"] == "https://pytorch.org/"


def test_a_pages_cuda_peak_leaves_out_memory_an_earlier_page_still_holds(monkeypatch):
    # A fake device: 1 GiB still live from an earlier page, then the example allocates 300
    # MiB more at its peak.
    mib = 2**20
    state = {"live": 1024 * mib, "peak": 1024 * mib}

    def allocate(size):
        state["live"] += size
        state["peak"] = max(state["peak"], state["live"])

    def reset_peak():
        state["peak"] = state["live"]

    cuda = cuda_peak_memory.torch.cuda
    monkeypatch.setattr(cuda, "memory_allocated", lambda: state["live"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset_peak)

    def example():
        allocate(300 * mib)
        allocate(-300 * mib)
        return "its result"

    assert cuda_peak_memory.cuda_peak_mib(example) == (300.0, "its result")


def test_the_install_cell_follows_an_example_into_its_section_folder(
    tmp_path, monkeypatch
):
    """sphinx-gallery names the example's file; the hook finds it in its section's folder."""
    (tmp_path / "privacy").mkdir()
    (tmp_path / "privacy" / "plot_x.py").write_text("import opacus\nimport torch\n")
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "plot_y.py").write_text("import torch\n")
    monkeypatch.setattr(notebook_install_cell, "EXAMPLES", tmp_path)
    conf = {}
    notebook_install_cell.first_cell_for_example(conf, "plot_x.py")
    assert '"opacus": "opacus==' in conf["first_notebook_cell"]
    notebook_install_cell.first_cell_for_example(conf, "plot_y.py")
    assert "opacus" not in conf["first_notebook_cell"]


# Shards: which examples `make html SHARD=i/N` executes.

TIMES = {"plot_a.py": 60.0, "plot_b.py": 30.0, "plot_c.py": 25.0, "plot_d.py": 20.0}


def test_shards_balance_the_recorded_times_not_the_counts():
    shards, load = gallery_shards.plan(sorted(TIMES), TIMES, 2)
    # By count, two and two (90 s against 45 s); by time, the long one alone.
    assert shards == [["plot_a.py"], ["plot_b.py", "plot_c.py", "plot_d.py"]]
    assert load == [60.0, 75.0]


def test_every_example_is_in_exactly_one_shard_whatever_the_count():
    names = sorted(TIMES) + ["plot_new.py"]  # no recorded time: counts as the median
    for count in range(1, len(names) + 1):
        shards, _ = gallery_shards.plan(names, TIMES, count)
        assert len(shards) == count and all(shards)
        assert sorted(name for shard in shards for name in shard) == names


def test_a_shard_executes_exactly_its_examples(tmp_path):
    for section, name in [
        ("one", "plot_a.py"),
        ("one", "plot_ab.py"),
        ("two", "plot_b.py"),
    ]:
        (tmp_path / "examples" / section).mkdir(parents=True, exist_ok=True)
        (tmp_path / "examples" / section / name).touch()
    times = tmp_path / "times.txt"
    times.write_text("# a note\n 50.0 plot_a.py\n 30.0 plot_ab.py\n 25.0 plot_b.py\n")
    first = gallery_shards.filename_pattern("", "1/2", tmp_path, times)
    second = gallery_shards.filename_pattern("", "2/2", tmp_path, times)
    paths = [
        f"/x/examples/{s}/{n}"
        for s, n in [("one", "plot_a.py"), ("one", "plot_ab.py"), ("two", "plot_b.py")]
    ]
    assert [bool(re.search(first, p)) for p in paths] == [True, False, False]
    assert [bool(re.search(second, p)) for p in paths] == [False, True, True]
    only = gallery_shards.filename_pattern("plot_a", "", tmp_path, times)
    assert [bool(re.search(only, p)) for p in paths] == [True, False, False]


@pytest.mark.parametrize(
    ("example", "shard", "message"),
    [
        ("", "3/2", "SHARD='3/2' is not a shard: write SHARD=i/N with 1 <= i <= N"),
        ("", "two", "SHARD='two' is not a shard"),
        ("", "0/3", "SHARD='0/3' is not a shard"),
        ("", "1/99", "use at most"),
        ("plot_a", "1/2", "give EXAMPLE= or SHARD=, not both"),
    ],
)
def test_a_shard_that_cannot_be_built_says_why(example, shard, message):
    with pytest.raises(gallery_shards.ShardError, match=re.escape(message)):
        gallery_shards.filename_pattern(example, shard)


def test_only_a_merge_refuses_to_execute_an_example(monkeypatch):
    monkeypatch.delenv("GALLERY_MERGE", raising=False)
    gallery_shards.refuse_to_execute({}, "plot_a.py")  # an ordinary build runs it
    monkeypatch.setenv("GALLERY_MERGE", "1")
    with pytest.raises(gallery_shards.ShardError, match="would execute plot_a.py"):
        gallery_shards.refuse_to_execute({}, "plot_a.py")


def test_the_recorded_times_name_only_examples_that_exist():
    recorded = gallery_shards.read_times()
    stale = sorted(set(recorded) - set(gallery_shards.examples()))
    assert not stale, (
        f"times recorded for examples that are gone: {stale}; make record-times"
    )
    assert len(recorded) >= len(gallery_shards.examples()) // 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("12.5", "expected 'SECONDS plot_name.py'"),
        ("0.00 plot_a.py", "with SECONDS > 0"),
    ],
)
def test_a_broken_times_file_is_named_with_its_line(tmp_path, line, message):
    times = tmp_path / "times.txt"
    times.write_text(f"# a note\n 3.0 plot_b.py\n{line}\n")
    with pytest.raises(gallery_shards.ShardError, match=rf"times.txt:3: .*{message}"):
        gallery_shards.read_times(times)


def test_a_shard_left_empty_is_refused_rather_than_running_everything(tmp_path):
    (tmp_path / "examples" / "one").mkdir(parents=True)
    for name in ("plot_a.py", "plot_b.py"):
        (tmp_path / "examples" / "one" / name).touch()
    times = tmp_path / "times.txt"
    times.write_text(" 1.0 plot_a.py\n 1.0 plot_b.py\n")
    assert gallery_shards.filename_pattern("", "2/2", tmp_path, times)
    with pytest.raises(gallery_shards.ShardError, match="use at most 2 shards"):
        gallery_shards.filename_pattern("", "3/3", tmp_path, times)


def test_the_times_are_read_from_sphinx_gallerys_execution_times_page():
    rst = (
        "   * - :ref:`sphx_glr_auto_examples_one_plot_a.py` (``../examples/one/plot_a.py``)\n"
        "     - 01:02.500\n"
        "   * - :ref:`sphx_glr_auto_examples_two_plot_b.py` (``../examples/two/plot_b.py``)\n"
        "     - 00:00.250\n"
    )
    assert gallery_shards.times_from_execution_page(rst) == {
        "plot_a.py": 62.5,
        "plot_b.py": 0.25,
    }


EXAMPLE_COMPILING = """
import torch
from torch.func import grad, vmap


def {helper}(x):
    return x.sin()


def energy(x):
    return (2 * {helper}(x)).sum()


compiled = torch.compile(vmap(grad(energy)), backend="eager", fullgraph=True)
result = compiled(torch.ones(3, 2))
"""


def run_as_main(source):
    """Run source as sphinx-gallery runs an example: in a ``__main__`` module of its own."""
    main = importlib.util.module_from_spec(
        importlib.util.spec_from_loader("__main__", None)
    )
    before = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(compile(source, "<example>", "exec"), main.__dict__)
    finally:
        sys.modules["__main__"] = before
    return main


def test_the_reset_lets_the_next_example_compile_a_transform_of_its_own_functions():
    """Dynamo keeps the first example's ``__main__`` for guards in torch's own frames."""
    run_as_main(EXAMPLE_COMPILING.format(helper="wave"))
    reset_between_examples.reset_state({}, "plot_second.py")
    second = run_as_main(EXAMPLE_COMPILING.format(helper="ripple"))
    torch.testing.assert_close(second.result, 2 * torch.ones(3, 2).cos())
