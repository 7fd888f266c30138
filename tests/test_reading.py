"""What a reader meets on every page: the recipe first and the measuring after it, one idea per
page, a short list of what to remember at the end, no machinery copied from page to page, one
colour per method across the site, and every timing beside its spread.

The source-level tests need no build and run in seconds; the others read the built pages.
"""

import ast
import collections
import functools
import io
import re
import tokenize

import pytest
import torch.func
from helpers import EXAMPLES, REPO, soup

FIRST_CALL_WITHIN = 80  # lines from the top of the source
PAGE_LINES_AT_MOST = 450
REPEATED_LINES_AT_MOST = 60  # over the whole gallery, counted once per page
# The three lines every page opens with (device, seed, hardware), copied on purpose: a reader
# meets the same first cell on every page. They are not machinery, and do not count.
OPENING_LINES = {
    'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")',
    "torch.manual_seed(0)",
    'print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads")',
}
REPEATED_IN_AT_LEAST = 3  # pages
# A line this short (`plt.show()`, `else:`) is idiom, not a copied helper.
SHORTEST_COUNTED_LINE = 20

# One colour per method across the site: colour-blind-safe hues from Okabe and Ito's palette
# and Tol's. Black is kept for guides: thresholds, fits, markers. A page declares, in a dict
# called METHOD_COLORS, only the methods it draws, each with its colour from here.
SITE_PALETTE = {
    "loop": "#D55E00",
    "vmap": "#009E73",
    "batched": "#666666",
    "jacrev": "#0072B2",
    "jacfwd": "#E69F00",
    "hessian": "#56B4E9",
    "jacrev(jacfwd)": "#882255",
    "sum trick": "#CC79A7",
    "vmap chunked": "#44AA99",
    "compiled": "#117733",
    "expanded weights": "#332288",
    "opacus": "#AA4499",
    "hand-written": "#999933",
    "ghost clipping": "#CC6677",
    "book-keeping": "#6699CC",
    "forward-over-reverse": "#EE3377",
    "reverse-over-reverse": "#997700",
    "reverse-over-forward": "#BBCC33",
    "GGN": "#EE8866",
    "ntk-vector products": "#5D69B1",
    "linearize": "#CC3311",
    "torch eager": "#004488",
    "JAX": "#EE7733",
    "JAX jit": "#DDAA33",
    "Hutchinson": "#AA3377",
    "MAML": "#994455",
    "joint training": "#225555",
    "flat vector": "#88CCEE",
    "vmap fallback": "#DDCC77",
    "nested jvp": "#666633",
    "module call": "#BB5566",
    "functional_call": "#009988",
    "loss.backward()": "#4477AA",
    "autograd.grad": "#EE6677",
    "func.grad": "#228833",
    "func.grad_and_value": "#CCBB44",
    "func.jvp": "#0077BB",
    "forward_ad": "#222255",
    "autograd.functional.jvp": "#7570B3",
    "double-backward trick": "#A6761D",
    "implicit": "#66A61E",
    "unrolled": "#663333",
    "atom chunks": "#6A3D9A",
    "checkpointed": "#8C564B",
}
HEX_COLOUR = re.compile(r"[\"']#[0-9A-Fa-f]{6}[\"']")


def source_of(example):
    return (REPO / "examples" / example).read_text(encoding="utf-8")


def first_torch_func_call(source):
    """Line of the first call of a torch.func function (imported from it, or torch.func.X)."""
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "torch.func"
        for alias in node.names
    }
    calls = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id in imported)
            or (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in torch.func.__all__
                and ast.unparse(node.func.value) == "torch.func"
            )
        )
    ]
    return min(calls, default=None)


def code_lines(source):
    """The distinct code lines of a page that could be a copied helper's: outside comments,
    docstrings and imports, at least SHORTEST_COUNTED_LINE characters, with a letter."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if (
            isinstance(
                node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            )
            and ast.get_docstring(node, clean=False) is not None
        ):
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    not_code = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    rows = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in not_code:
            rows.update(range(token.start[0], token.end[0] + 1))
    lines = source.splitlines()
    stripped = (lines[row - 1].strip() for row in rows - docstrings)
    return {
        line
        for line in stripped
        if len(line) >= SHORTEST_COUNTED_LINE
        and line not in OPENING_LINES
        and re.search("[A-Za-z]", line)
        and not line.startswith(("import ", "from "))
    }


def repeated_lines(sources):
    """{line: number of pages} for the lines that stand in REPEATED_IN_AT_LEAST pages."""
    pages = collections.Counter(
        line for source in sources for line in code_lines(source)
    )
    return {
        line: count for line, count in pages.items() if count >= REPEATED_IN_AT_LEAST
    }


def method_colors(source):
    """The METHOD_COLORS dict a page defines, and the lines it spans (first, last)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "METHOD_COLORS" for t in node.targets
        ):
            return ast.literal_eval(node.value), (node.lineno, node.end_lineno)
    return {}, None


# The recipe first -------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_page_reaches_torch_func_within_its_first_80_lines(example):
    line = first_torch_func_call(source_of(example))
    assert line is not None, f"{example} calls no torch.func function"
    assert line <= FIRST_CALL_WITHIN, (
        f"{example}: the first torch.func call is at line {line}"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_page_holds_one_idea_in_at_most_450_lines(example):
    lines = len(source_of(example).splitlines())
    assert lines <= PAGE_LINES_AT_MOST, f"{example} has {lines} lines"


def test_the_gallery_repeats_at_most_100_code_lines():
    repeats = repeated_lines(source_of(example) for example in EXAMPLES)
    total = sum(repeats.values())
    worst = sorted(repeats.items(), key=lambda item: -item[1])[:15]
    assert total <= REPEATED_LINES_AT_MOST, (
        f"{total} code lines stand in {REPEATED_IN_AT_LEAST} or more pages; the most "
        "repeated:\n" + "\n".join(f"{count:3d}  {line}" for line, count in worst)
    )


def test_the_repeat_count_sees_a_helper_copied_into_three_pages():
    helper = (
        "def median_time_ms(fn):\n"
        "    timer = Timer(stmt='fn()', globals={'fn': fn})\n"
        "    return timer.blocked_autorange().median * 1e3\n"
    )
    pages = [
        f'"""Page {n}."""\nimport torch\n\n{helper}\nprint("page {n}")\n' for n in "abc"
    ]
    # the def line and the two body lines; not the docstring, the import or the prints
    assert repeated_lines(pages) == {
        "def median_time_ms(fn):": 3,
        "timer = Timer(stmt='fn()', globals={'fn': fn})": 3,
        "return timer.blocked_autorange().median * 1e3": 3,
    }
    assert repeated_lines(pages[:2]) == {}
    # The opening cell every page copies on purpose is not counted; a helper beside it is.
    opening = "\n".join(sorted(OPENING_LINES))
    assert repeated_lines([f"{opening}\n{helper}" for _ in "abc"]) == repeated_lines(
        pages
    )


def test_the_first_call_is_found_however_the_function_is_named():
    assert (
        first_torch_func_call("from torch.func import grad as g\n\ny = g(f)(x)\n") == 3
    )
    assert (
        first_torch_func_call("import torch\n\nx = 1\nj = torch.func.jacrev(f)\n") == 4
    )
    assert first_torch_func_call("from torch.func import vmap\n# vmap(f)\n") is None


# One colour per method --------------------------------------------------------------------


def test_the_site_palette_gives_each_method_its_own_colour():
    colours = list(SITE_PALETTE.values())
    assert len(set(colours)) == len(colours), "two methods share a colour"
    assert "#000000" not in colours, "black is for guides, not for a method"


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_page_declares_only_the_colours_it_draws_from_the_site_palette(example):
    source = source_of(example)
    colours, span = method_colors(source)
    for method, colour in colours.items():
        assert SITE_PALETTE.get(method) == colour, (
            f"{example} colours {method!r} {colour}; the site's colour is "
            f"{SITE_PALETTE.get(method)}"
        )
    lines = source.splitlines()
    outside = lines[: span[0] - 1] + lines[span[1] :] if span else lines
    stray = [line.strip() for line in outside if HEX_COLOUR.search(line)]
    assert not stray, f"{example} picks colours outside METHOD_COLORS: {stray}"
    rest = "\n".join(outside)
    unused = [m for m in colours if f'"{m}"' not in rest and f"'{m}'" not in rest]
    assert not unused, f"{example} declares colours it never uses: {unused}"


# What the built page shows ----------------------------------------------------------------


def output_of(page):
    return "\n".join(
        pre.get_text() for pre in page.select("div.sphx-glr-script-out pre")
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_page_ends_with_what_to_remember(site, example):
    page = soup(site.page(example))
    sections = page.select("article section section")
    assert sections, f"{example}: no sections"
    last = sections[-1]
    assert last.find(["h2", "h3"]).get_text().strip("¶# ") == "What to remember"
    items = last.select("li")
    assert 3 <= len(items) <= 5, f"{example}: {len(items)} things to remember"


# A time printed with its unit: "12.3 ms", "450 µs", "1.2 s".
TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|µs|us|s)\b")


# The pages that time something: they call torch.utils.benchmark's timer.
TIMED = [e for e in EXAMPLES if "blocked_autorange" in source_of(e)]


@pytest.mark.parametrize("example", TIMED, ids=str)
def test_every_timing_on_the_page_stands_beside_its_spread(site, example):
    output = output_of(soup(site.page(example)))
    timed = [line for line in output.splitlines() if TIMING.search(line)]
    assert timed, f"{example} times with blocked_autorange but prints no time"
    # A time measured once (a compilation, one profiled call) says so instead.
    once = ("IQR", "measured once", "one profiled call")
    bare = [line for line in timed if not any(mark in line for mark in once)]
    assert not bare, f"{example} prints times without their spread: {bare[:5]}"


# A spread printed as zero: "IQR 0.00 ms" after a single block says the times did not vary.
ZERO_SPREAD = re.compile(r"IQR:? ?[±]?0(\.0+)? ?(ms|µs|us|s)\b")


@pytest.mark.parametrize("example", TIMED, ids=str)
def test_no_spread_on_the_page_reads_zero(site, example):
    output = output_of(soup(site.page(example)))
    zero = [line for line in output.splitlines() if ZERO_SPREAD.search(line)]
    assert not zero, (
        f"{example} prints a spread of zero (one block, or too few digits): {zero[:5]}"
    )


# A ratio below 1 called a speed-up: "0.12x faster" means "takes 8.3x the time".
UPSIDE_DOWN = re.compile(r"\b0\.\d+ ?[x×] (faster|slower|speed-?up|quicker)", re.I)


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_no_ratio_below_one_is_called_faster_or_slower(site, example):
    page = soup(site.page(example))
    text = output_of(page) + "\n" + page.select_one("article").get_text(" ")
    wrong = [m.group(0) for m in UPSIDE_DOWN.finditer(text)]
    assert not wrong, f"{example} words a ratio below 1 as a speed: {wrong[:5]}"


def test_the_reading_checks_see_a_zero_spread_and_an_upside_down_ratio():
    assert ZERO_SPREAD.search("vmap: 1.20 ms (IQR 0.00 ms, 1 block)")
    assert not ZERO_SPREAD.search("vmap: 1.20 ms (IQR 0.04 ms)")
    assert UPSIDE_DOWN.search("compiled is 0.12x faster than eager")
    assert not UPSIDE_DOWN.search("compiled takes 8.3x the loop's time; 1.20x faster")


# The questions page ------------------------------------------------------------------------

QUESTIONS_AT_LEAST = 60


@functools.cache
def ids_on(path):
    return {tag["id"] for tag in soup(path).select("[id]")}


def test_every_question_links_where_it_was_asked_and_an_executed_answer(site):
    """Each question on the questions page names the thread where a user asked it and links to
    the section of an example page that answers it; that section exists on the built page."""
    page = soup(site.html / "questions.html")
    questions = [li for li in page.select("article li") if "Asked in" in li.get_text()]
    assert len(questions) >= QUESTIONS_AT_LEAST, f"{len(questions)} questions"
    missing = []
    for question in questions:
        links = [a["href"] for a in question.select("a[href]")]
        asked = [href for href in links if href.startswith("https://")]
        answers = [href for href in links if href.startswith("auto_examples/")]
        text = question.get_text(" ", strip=True)[:80]
        assert asked, f"no link to where it was asked: {text}"
        assert answers, f"no answer on the site: {text}"
        for href in answers:
            path, _, anchor = href.partition("#")
            target = site.html / path
            assert target.is_file(), f"{text}: {path} is not a page"
            assert anchor, f"{text}: {href} names no section"
            if anchor not in ids_on(target):
                missing.append(href)
    assert not missing, f"answers whose section is not on the page: {missing}"
