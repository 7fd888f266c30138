"""The built site in a real browser: headless Chromium (the system's), driven by Playwright.

The site is served on 127.0.0.1 on an ephemeral port, under the same sub-path as on GitHub Pages,
and like GitHub Pages the server answers an unknown address with the site's 404 page. Every
page load records every request:
anything that fails, anything that goes to another host, and any console error fails the test.
Screenshots of both themes land in test-artifacts/ (git-ignored).
"""

import functools
import io
import os
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from axe_playwright_python.sync_playwright import Axe
from helpers import EXAMPLES, PAGES_PREFIX, REPO
from PIL import Image
from playwright.sync_api import sync_playwright

# The system's Chromium (Debian: apt-get install chromium); CHROMIUM=/path overrides it, as on
# GitHub's Ubuntu runners, which ship Google Chrome instead.
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a headless, offline browser: no first-run setup, no background calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"
PHONE = {"width": 390, "height": 844}
CONTENT_TYPES = {".ipynb": "application/x-ipynb+json", ".py": "text/x-python"}


class PagesLikeHandler(SimpleHTTPRequestHandler):
    """Serves the site under PAGES_PREFIX; anything else gets 404.html with status 404."""

    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **CONTENT_TYPES}

    def translate_path(self, path):
        inside = path.startswith(PAGES_PREFIX)
        local = super().translate_path("/" + path.removeprefix(PAGES_PREFIX))
        return local if inside else "/nonexistent"

    def send_error(self, code, message=None, explain=None):
        page = Path(self.directory) / "404.html"
        if code != 404 or not page.is_file():
            return super().send_error(code, message, explain)
        body = page.read_bytes()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url(site):
    handler = functools.partial(PagesLikeHandler, directory=str(site.html))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: an ephemeral port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}{PAGES_PREFIX}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: install it (apt-get install chromium)"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


class Visit:
    """One page in a fresh browser context, with every request and console error recorded.

    By default the visit waits until the network is idle, scrolls to the end and waits again,
    so that every request the page makes is seen. With ``settle=False`` it stops at the load
    event (styles and images in), enough for layout.
    """

    def __init__(
        self,
        browser,
        base_url,
        path,
        viewport=None,
        expect_status=200,
        settle=True,
        wait=True,
    ):
        self.context = browser.new_context(
            viewport=viewport or {"width": 1280, "height": 900}
        )
        self.page = self.context.new_page()
        self.base_url = base_url
        self.address = base_url + path
        self.expect_status = expect_status
        self.requests, self.problems = [], []
        page = self.page
        page.on("request", lambda request: self.requests.append(request.url))
        page.on(
            "requestfailed",
            lambda r: self.problems.append(f"failed: {r.url} {r.failure}"),
        )
        page.on("response", self._check_status)
        page.on("console", self._check_console)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        if not settle:
            page.goto(base_url + path, wait_until="load")
            return
        # The request is sent; with wait=False the caller starts other pages loading at the
        # same time, then settles each (see `loaded`).
        page.goto(base_url + path, wait_until="commit")
        if wait:
            self.settle()

    def settle(self):
        """Wait until the network is idle, scroll to the end so that every image is
        requested, lazy or not, and wait again."""
        self.page.wait_for_load_state("load")
        self.page.wait_for_load_state("networkidle")
        # Lazy images load now; the jump is instant: the theme scrolls smoothly, and a smooth
        # scroll holds the call for 1.5 s a page.
        self.page.evaluate(
            "document.querySelectorAll('img[loading=lazy]').forEach(i => i.loading = 'eager');"
            "window.scrollTo({top: document.body.scrollHeight, behavior: 'instant'})"
        )
        self.page.wait_for_load_state("networkidle")

    def _check_status(self, response):
        if response.url == self.address and response.status == self.expect_status:
            return
        if response.status >= 400:
            self.problems.append(f"HTTP {response.status}: {response.url}")

    def _check_console(self, message):
        expected = (
            self.expect_status != 200
            and message.location.get("url") == self.address
            and message.text.startswith("Failed to load resource")
        )  # the browser reports the status we asked for, a 404 page's own 404
        if message.type == "error" and not expected:
            self.problems.append(f"console error: {message.text}")

    def assert_clean(self):
        """No failed request, no console error, no request to another host."""
        assert not self.problems, "\n".join(self.problems)
        foreign = [
            url for url in self.requests if not url.startswith((self.base_url, "data:"))
        ]
        assert not foreign, f"requests to other hosts: {foreign}"
        assert any(url.startswith(self.base_url) for url in self.requests)

    def broken_images(self):
        return self.page.evaluate(
            "[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
        )

    def close(self):
        self.context.close()


@pytest.fixture
def visit(browser, base_url):
    visits = []

    def open_page(path, viewport=None, expect_status=200, settle=True):
        visits.append(Visit(browser, base_url, path, viewport, expect_status, settle))
        return visits[-1]

    yield open_page
    for opened in visits:
        opened.close()


@pytest.fixture(scope="module")
def loaded(browser, base_url):
    """One desktop visit per page, shared by the tests that only read the loaded page.

    The tests that click, resize or inject scripts open their own visits instead. On first
    use it loads every page of PAGES, LOADING_AT_ONCE at a time: their waits for an idle
    network overlap.
    """
    visits = {}

    def open_once(path):
        if not visits:
            for start in range(0, len(PAGES), LOADING_AT_ONCE):
                batch = PAGES[start : start + LOADING_AT_ONCE]
                started = [Visit(browser, base_url, p, wait=False) for p in batch]
                for page in started:
                    page.settle()
                visits.update(zip(batch, started))
        if path not in visits:
            visits[path] = Visit(browser, base_url, path)
        return visits[path]

    yield open_once
    for opened in visits.values():
        opened.close()


LOADING_AT_ONCE = 6
EXAMPLE_PAGES = [f"auto_examples/{e.with_suffix('.html')}" for e in EXAMPLES]
PAGES = [
    "index.html",
    "auto_examples/index.html",
    "api.html",
    "reading-timings.html",
    "building.html",
    "questions.html",
    "sg_execution_times.html",
    "search.html",
    *EXAMPLE_PAGES,
]


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_cleanly_with_every_image_and_only_local_requests(loaded, path):
    page = loaded(path)
    page.assert_clean()
    assert not page.broken_images()
    alt_texts = page.page.evaluate(
        "[...document.images].map(i => [i.src, i.alt || ''])"
    )
    for (
        src,
        alt,
    ) in alt_texts:  # alt text that says what the image shows, not a file name
        assert len(alt.split()) >= 3 and not alt.endswith((".png", ".svg")), (src, alt)
    favicon = page.page.eval_on_selector("link[rel~='icon']", "link => link.href")
    assert page.page.request.get(favicon).status == 200, f"favicon {favicon} is missing"


def test_gallery_shows_one_thumbnail_per_example_each_linking_to_it(visit, base_url):
    gallery = visit("auto_examples/index.html")
    thumbnails = gallery.page.locator("div.sphx-glr-thumbcontainer")
    assert thumbnails.count() == len(EXAMPLES)
    targets = [
        thumbnails.nth(i).locator("a").first.evaluate("a => a.href")
        for i in range(thumbnails.count())
    ]
    assert sorted(targets) == sorted(base_url + path for path in EXAMPLE_PAGES)
    thumbnails.last.click()  # a click anywhere on the card follows its link
    gallery.page.wait_for_load_state("networkidle")
    assert gallery.page.url == targets[-1]
    gallery.assert_clean()


@pytest.mark.parametrize("path", EXAMPLE_PAGES)
def test_example_page_shows_code_output_figure_time_and_downloads(loaded, path):
    example = loaded(path)
    page = example.page
    assert page.locator("div.highlight-Python pre").count() >= 3
    assert page.locator("div.sphx-glr-script-out pre").first.is_visible()
    figures = page.locator("img.sphx-glr-single-img, img.sphx-glr-multi-img")
    assert figures.count() >= 1 and figures.first.is_visible()
    assert page.get_by_text("Total running time of the script").is_visible()

    buttons = page.locator("p.example-buttons a")
    hrefs = {
        buttons.nth(i).inner_text(): buttons.nth(i).get_attribute("href")
        for i in range(3)
    }
    for label, suffix in [
        ("Download notebook", ".ipynb"),
        ("Download Python source", ".py"),
    ]:
        url = page.url.rsplit("/", 1)[0] + "/" + hrefs[label]
        response = page.request.get(url)
        assert response.status == 200, url
        assert response.headers["content-type"].split(";")[0] == CONTENT_TYPES[suffix]
    example.assert_clean()


@pytest.mark.parametrize(
    "query, expected",
    [
        ("vmap", {"plot_per_sample_grads", "plot_batch_jacobians_hessians"}),
        ("jacrev", {"plot_jacobians_hessians", "plot_per_sample_param_jacobians"}),
        ("hessian", {"plot_jacobians_hessians", "plot_batch_jacobians_hessians"}),
        ("hand-written derivative", {"plot_against_a_hand_written_derivative"}),
        # An error message pasted into the search finds the troubleshooting entry for it.
        ("ZeroTensors are immutable", {"plot_troubleshooting"}),
        ("jacrev: Expected all inputs to be real", {"plot_troubleshooting"}),
        ("would mutate a captured Tensor", {"plot_troubleshooting"}),
        ("don't yet support saved tensor hooks", {"plot_troubleshooting_arguments"}),
        (
            "to return a scalar Tensor, got tensor with 1 dims",
            {"plot_troubleshooting_arguments"},
        ),
        ("Trying to use forward AD with igamma", {"plot_troubleshooting_libraries"}),
        (
            "Inference tensors cannot be saved for backward",
            {"plot_troubleshooting_custom_and_compiled"},
        ),
        (
            "RuntimeError when making fake tensor call",
            {"plot_troubleshooting_custom_and_compiled"},
        ),
        (
            "FALLBACK path has been taken inside",
            {"plot_troubleshooting_compiled_scripted_seeded"},
        ),
        (
            "Cannot insert a Tensor that requires grad as a constant",
            {"plot_troubleshooting_versions_and_export"},
        ),
        (
            "Cannot access storage of TensorWrapper",
            {"plot_troubleshooting_indices_and_batched_grads"},
        ),
        (
            "Thing passed to transform API must be Tensor",
            {"plot_troubleshooting_indices_and_batched_grads"},
        ),
        ("attn_bias: wrong shape", {"plot_troubleshooting_cuda_kernels"}),
        ("aten::_cudnn_rnn_backward", {"plot_troubleshooting_cuda_kernels"}),
        (
            "batched == nullptr INTERNAL ASSERT FAILED",
            {"plot_troubleshooting_escaped_tensors"},
        ),
        (
            "The stateless API can't be used with Jitted modules",
            {"plot_troubleshooting_refused_modules_and_nan"},
        ),
        ("lu_solve reads an unsqueezed LU", {"plot_troubleshooting_batched_linalg"}),
        (
            "A different number of tensors was saved during the original forward",
            {"plot_troubleshooting_training_through_jvp"},
        ),
        ("inference_mode return zeros", {"plot_troubleshooting_fixed_reports"}),
        (
            "There is a performance drop because we have not yet implemented",
            {"plot_troubleshooting_fixed_reports"},
        ),
        (
            "accessing data under vmap transform",
            {
                "plot_troubleshooting_eager_only",
                "plot_troubleshooting_indices_and_batched_grads",
            },
        ),
        ("querying is_contiguous inside of vmap", {"plot_troubleshooting_eager_only"}),
        ("mat2 must be a matrix", {"plot_troubleshooting_eager_only"}),
        ("hit the vmap fallback", {"plot_operators_under_vmap"}),
        (
            "Got in_dim=0 for an input but the input is of type",
            {"plot_pytrees_under_transforms"},
        ),
        (
            "Batching rule not implemented for aten::item",
            {"plot_troubleshooting_eager_only"},
        ),
        (
            "the fallback path doesn't work on out= or view ops",
            {"plot_troubleshooting_eager_only"},
        ),
        (
            "Expected 2D (unbatched) or 3D (batched) input to conv1d",
            {"plot_troubleshooting_batch_assumed"},
        ),
        (
            "mat1 and mat2 shapes cannot be multiplied",
            {"plot_troubleshooting_batch_assumed"},
        ),
        ("expected 4D input (got 3D input)", {"plot_troubleshooting_batch_assumed"}),
        (
            "Trying to use forward AD with mkldnn_rnn_layer",
            {"plot_troubleshooting_lstm_and_one_hot"},
        ),
        (
            "Cannot call numel() on tensor with symbolic sizes",
            {"plot_troubleshooting_lstm_and_one_hot"},
        ),
        (
            "inplace arithmetic(self, *extra_args) is not possible",
            {"plot_troubleshooting_lstm_and_one_hot"},
        ),
        (
            "appears to not have been used in the graph",
            {
                "plot_troubleshooting",
                "plot_troubleshooting_one_sample_numpy_and_integers",
            },
        ),
        (
            "Expected primal to be floating point or complex",
            {"plot_troubleshooting_one_sample_numpy_and_integers"},
        ),
        (
            "Can't call numpy() on Tensor that requires grad",
            {"plot_troubleshooting_one_sample_numpy_and_integers"},
        ),
        (
            "There is a performance drop because we have not yet implemented the batching "
            "rule for aten::mse_loss_backward. Please file us an issue on GitHub so that we "
            "can prioritize its implementation.",
            {"plot_troubleshooting_hessian_memory_and_block_masks"},
        ),
        (
            "CUDA out of memory. Tried to allocate",
            {"plot_troubleshooting_hessian_memory_and_block_masks"},
        ),
        (
            "Expected tensors, got unsupported type <class 'str'>",
            {"plot_troubleshooting_float_arguments_aux_and_batchnorm"},
        ),
        (
            "replace_all_batch_norm_modules_",
            {"plot_troubleshooting_float_arguments_aux_and_batchnorm"},
        ),
        (
            "Error(s) in loading state_dict",
            {"plot_troubleshooting_generated_weights_and_memory_growth"},
        ),
        (
            "hypernetwork",
            {"plot_troubleshooting_generated_weights_and_memory_growth"},
        ),
    ],
)
def test_search_finds_the_examples(visit, query, expected):
    search = visit(f"search.html?q={query}")
    search.page.wait_for_selector("#search-results ul.search li", timeout=15_000)
    hrefs = search.page.eval_on_selector_all(
        "#search-results ul.search li a", "links => links.map(a => a.href)"
    )
    found = {href.rsplit("/", 1)[-1].split(".html")[0] for href in hrefs}
    assert expected <= found, f"search for {query!r} found {sorted(found)}"
    search.assert_clean()


def set_theme(page, theme):
    """Click furo's theme toggle until the page shows `theme` (it cycles auto/dark/light)."""
    toggle = page.locator("button.theme-toggle:visible").first
    for _ in range(3):
        if page.evaluate("document.body.dataset.theme") == theme:
            return
        toggle.click()
    assert page.evaluate("document.body.dataset.theme") == theme


def contrast(png_bytes):
    """Fractions of light (background) and dark (text, lines) pixels in a screenshot."""
    pixels = np.asarray(Image.open(io.BytesIO(png_bytes)).convert("L"))
    return float((pixels > 200).mean()), float((pixels < 90).mean())


def test_theme_switch_works_and_figures_stay_legible_in_both(visit):
    ARTIFACTS.mkdir(exist_ok=True)
    example = visit(EXAMPLE_PAGES[0])
    page = example.page
    backgrounds = {}
    for theme in ("light", "dark"):
        set_theme(page, theme)
        backgrounds[theme] = page.evaluate(
            "getComputedStyle(document.body).backgroundColor"
        )
        page.screenshot(path=ARTIFACTS / f"example-{theme}.png", full_page=True)
        figure = page.locator("img.sphx-glr-single-img").first
        figure.scroll_into_view_if_needed()
        light, dark = contrast(
            figure.screenshot(path=ARTIFACTS / f"figure-{theme}.png")
        )
        # A legible figure: a light background with dark text and lines on it.
        assert light > 0.5 and dark > 0.002, (
            f"{theme}: light {light:.3f}, dark {dark:.4f}"
        )
    assert backgrounds["light"] != backgrounds["dark"], (
        "the theme switch changed nothing"
    )
    example.assert_clean()


@pytest.mark.parametrize("path", EXAMPLE_PAGES)
def test_phone_sized_viewport_never_scrolls_sideways(visit, path):
    page = visit(path, viewport=PHONE, settle=False).page  # layout needs no more
    overflow = page.evaluate(
        "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0, (
        f"{path} is {overflow}px wider than a {PHONE['width']}px phone"
    )


@pytest.mark.parametrize(
    "path, status",
    [
        ("index.html", 200),
        ("auto_examples/index.html", 200),
        ("api.html", 200),
        (EXAMPLE_PAGES[0], 200),
        ("no/such/page.html", 404),
    ],
)
def test_no_serious_accessibility_violations(visit, path, status):
    page = visit(path, expect_status=status).page
    results = Axe().run(page)
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} - {[n['target'] for n in v['nodes']][:5]}"
        for v in results.response["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert not serious, "\n".join(serious)


def test_an_unknown_address_gets_the_sites_404_page_with_working_links(visit, base_url):
    missing = visit("no/such/page.html", expect_status=404)
    page = missing.page
    assert page.locator("h1").inner_text().startswith("Page not found")
    missing.assert_clean()  # the theme's styles and scripts load from under the sub-path
    assert not missing.broken_images()
    for href in page.eval_on_selector_all(
        "article a.reference.internal", "links => links.map(a => a.href)"
    ):
        assert href.startswith(base_url), href
        assert page.request.get(href).status == 200, href


def test_copy_buttons_copy_the_code_without_its_output(browser, base_url):
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    try:
        page = context.new_page()
        page.goto(base_url + EXAMPLE_PAGES[0], wait_until="networkidle")
        code = page.locator("div.highlight-Python").nth(1)
        assert page.locator("div.sphx-glr-script-out button.copybtn").count() == 0
        code.hover()
        code.locator("button.copybtn").click()
        copied = page.evaluate("navigator.clipboard.readText()")
        assert copied.strip() == code.locator("pre").inner_text().strip()
        assert copied.strip()
    finally:
        context.close()
