"""A build split into shards, then merged without running anything: what CI does.

`make html SHARD=i/N` executes one shard's examples; `make merge FROM=folder` builds the site
from the shards' galleries. These tests build two shards of three quick examples, each in its
own copy of the sources as a CI job would, and merge them in a third.
"""

import shutil

import pytest
from helpers import example_path, make, small_site, soup

QUICK = (
    "plot_extending_torch_func.py",
    "plot_functorch_migration.py",
    "plot_pitfalls.py",
)


def gallery_outputs(html_page):
    """The printed output blocks of one built example page, as text."""
    return [
        pre.get_text() for pre in soup(html_page).select("div.sphx-glr-script-out pre")
    ]


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Two shards built apart, their galleries gathered in one folder, and the merge."""
    outputs = tmp_path_factory.mktemp("shard-outputs")
    trees, logs = [], []
    for index in (1, 2):
        tree = small_site(tmp_path_factory.mktemp(f"shard-{index}"), examples=QUICK)
        result = make(tree, "html", f"SHARD={index}/2")
        log = result.stdout + result.stderr
        assert result.returncode == 0, log[-3000:]
        shutil.copytree(tree / "docs" / "auto_examples", outputs / f"shard-{index}")
        trees.append(tree)
        logs.append(log)
    merged = small_site(tmp_path_factory.mktemp("merged"), examples=QUICK)
    result = make(merged, "merge", f"FROM={outputs}")
    return {
        "outputs": outputs,
        "trees": trees,
        "logs": logs,
        "merged": merged,
        "merge": result,
        "merge_log": result.stdout + result.stderr,
    }


def page_of(tree, name):
    return (
        tree
        / "_build"
        / "html"
        / "auto_examples"
        / example_path(name).with_suffix(".html")
    )


def test_each_shard_executes_only_its_own_examples(shards):
    ran = []
    for tree, log in zip(shards["trees"], shards["logs"]):
        gallery = tree / "docs" / "auto_examples"
        executed = sorted(
            p.name.removesuffix(".md5") for p in gallery.rglob("plot_*.py.md5")
        )
        count = len(executed)
        assert f"executed {count} out of {count} file{'s' * (count != 1)} " in log
        ran.append(executed)
    assert all(ran), f"a shard ran nothing: {ran}"
    assert sorted(ran[0] + ran[1]) == sorted(QUICK), ran


def test_the_merge_executes_nothing_and_keeps_each_shards_output(shards):
    log = shards["merge_log"]
    assert shards["merge"].returncode == 0, log[-3000:]
    assert "merged 3 examples from 2 shards" in log
    assert "executed 0 out of 0 files" in log
    assert "excluding 3 files that had previously been run" in log
    assert "Built the site from the shards, running no example" in log
    # A re-run would print other timings: each page's output is its shard's, to the letter.
    for name in QUICK:
        (shard,) = [t for t in shards["trees"] if list(t.rglob(f"{name}.md5"))]
        assert gallery_outputs(page_of(shards["merged"], name)) == gallery_outputs(
            page_of(shard, name)
        ), name


def test_the_merged_pages_are_those_of_a_one_runner_build(shards, site):
    """Output blocks, figures, downloads and notebooks, as the whole site's own build has them.

    In `make test` that is a one-runner build; under `make test-merged` (CI), the merge of CI's
    own shards, which this then compares with a merge of two shards built here.
    """
    merged_html = shards["merged"] / "_build" / "html"
    for name in QUICK:
        merged, whole = (
            soup(page_of(shards["merged"], name)),
            soup(site.page(example_path(name))),
        )
        assert len(gallery_outputs(page_of(shards["merged"], name))) == len(
            gallery_outputs(site.page(example_path(name)))
        ), name
        own = f"sphx_glr_{name.removesuffix('.py')}_0"  # not the related examples' thumbnails
        figures = [img["src"] for img in merged.select("img") if own in img["src"]]
        assert figures, name
        assert figures == [
            img["src"] for img in whole.select("img") if own in img["src"]
        ]
        for src in figures:
            assert (page_of(shards["merged"], name).parent / src).is_file(), src
        downloads = [a["href"] for a in merged.select("a.download")]
        assert len(downloads) >= 2 and downloads == [
            a["href"] for a in whole.select("a.download")
        ]
        for (
            href
        ) in downloads:  # same hashed folder: the same bytes as the one-runner build
            assert (page_of(shards["merged"], name).parent / href).is_file(), href
    stems = {name.removesuffix(".py") for name in QUICK}
    notebooks = sorted(p.stem for p in (merged_html / "_downloads").rglob("*.ipynb"))
    assert notebooks == sorted(stems)


def test_a_shard_that_failed_an_example_makes_the_merge_fail_naming_it(tmp_path):
    tree = small_site(tmp_path / "shard", examples=("plot_extending_torch_func.py",))
    source = tree / "examples" / example_path("plot_extending_torch_func.py")
    broken = source.with_name("plot_broken_copy.py")
    text = source.read_text(encoding="utf-8")
    broken.write_text(text + "\nassert False, 'a check that fails'\n", encoding="utf-8")
    shard = make(tree, "html", "SHARD=1/1")
    assert (
        shard.returncode != 0 and "plot_broken_copy.py" in shard.stdout + shard.stderr
    )
    outputs = tmp_path / "outputs"
    shutil.copytree(tree / "docs" / "auto_examples", outputs / "shard-1")
    merged = small_site(tmp_path / "merged", examples=("plot_extending_torch_func.py",))
    shutil.copy2(broken, merged / "examples" / broken.parent.name / broken.name)
    result = make(merged, "merge", f"FROM={outputs}")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert f"no shard in '{outputs}' ran examples/guides/plot_broken_copy.py" in log
    assert "Built the site" not in log


def test_a_merge_that_would_run_an_example_stops_and_names_it(shards, tmp_path):
    """A shard's output from another version of the source: sphinx-gallery would re-run it."""
    tree = small_site(tmp_path, examples=QUICK)
    changed = tree / "examples" / example_path("plot_pitfalls.py")
    changed.write_text(
        changed.read_text(encoding="utf-8") + "\n# edited\n", encoding="utf-8"
    )
    result = make(tree, "merge", f"FROM={shards['outputs']}")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "the merge would execute" in log and "plot_pitfalls.py" in log
    assert "Built the site" not in log


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["merge"], "say where the shards' outputs are: make merge FROM=folder"),
        (["merge", "FROM=/nonexistent"], "no shard outputs in '/nonexistent'"),
        (["html", "SHARD=4/3"], "SHARD='4/3' is not a shard: write SHARD=i/N"),
        (["html", "SHARD=1/9"], "9 shards for 1 examples would leave a shard empty"),
        (
            ["test-shard"],
            "say which shard's notebooks to run: make test-shard SHARD=i/N",
        ),
        (
            ["html", "SHARD=1/1", "EXAMPLE=plot_extending_torch_func"],
            "give EXAMPLE= or SHARD=, not both",
        ),
    ],
)
def test_a_wrong_shard_or_merge_says_what_is_wrong(tmp_path, args, message):
    result = make(small_site(tmp_path), *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "Built the site" not in result.stdout


def test_a_merge_from_one_gallery_instead_of_shards_says_so(shards, tmp_path):
    result = make(
        small_site(tmp_path, examples=QUICK),
        "merge",
        f"FROM={shards['outputs']}/shard-1",
    )
    assert result.returncode != 0
    assert "holds one gallery, not one folder per shard" in result.stderr
