"""Three buttons under each example's title: Run in Google Colab, Download notebook, Download
Python source.

sphinx-gallery ends every example page with a footer of download links and opens it with a
"Go to the end" note. This extension copies the footer's two download links into a row of
buttons right under the title, where a reader looks first, and adds a Colab link that opens the
published notebook. The note is hidden by its documented CSS class,
``sphx-glr-download-link-note`` (see _static/site.css). Everything works on doctree nodes,
keyed on the classes of sphinx-gallery's download containers, so a change in sphinx-gallery's
wording changes nothing here; a change in its structure fails the build, naming the page.
"""

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError

# sphinx-gallery's download containers, and the button each one becomes.
DOWNLOADS = {
    "sphx-glr-download-jupyter": "Download notebook",
    "sphx-glr-download-python": "Download Python source",
}


def is_example_page(doctree):
    return any(
        "sphx-glr-footer-example" in node["classes"]
        for node in doctree.findall(nodes.container)
    )


def download_links(doctree, docname):
    """{button text: the footer's download_reference node} for the notebook and the script."""
    links = {}
    for container in doctree.findall(nodes.container):
        for css_class, text in DOWNLOADS.items():
            if css_class in container["classes"]:
                found = list(container.findall(addnodes.download_reference))
                if len(found) != 1:
                    raise ExtensionError(
                        f"{docname}: no single download in {css_class}"
                    )
                links[text] = found[0]
    if set(links) != set(DOWNLOADS.values()):
        raise ExtensionError(
            f"{docname}: sphinx-gallery's download footer changed; buttons not added"
        )
    return links


def colab_url(config, published_path):
    where = config.colab_notebooks
    return (
        f"https://colab.research.google.com/github/{where['repository']}"
        f"/blob/{where['branch']}/_downloads/{published_path}"
    )


def add_buttons(app, doctree, docname):
    """doctree-resolved: the download nodes carry their published paths by now."""
    if not is_example_page(doctree):
        return
    links = download_links(doctree, docname)
    buttons = nodes.paragraph(classes=["example-buttons"])
    if app.config.colab_notebooks.get("repository"):
        notebook = links["Download notebook"]
        if "filename" not in notebook:
            raise ExtensionError(
                f"{docname}: the notebook download has no published path"
            )
        buttons += nodes.reference(
            "",
            "Run in Google Colab",
            refuri=colab_url(app.config, notebook["filename"]),
            classes=["colab-button"],
        )
        buttons += nodes.Text(" ")
    for text, link in links.items():
        # The reference's attributes (its target and published path) without its children.
        # Not copy.deepcopy: that follows the node's parent and copies the whole page.
        button = link.copy()
        button += nodes.literal("", text, classes=["xref", "download"])
        buttons += button
        buttons += nodes.Text(" ")
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        raise ExtensionError(f"{docname}: no title to put the buttons under")
    section.insert(1, buttons)


def setup(app):
    app.add_config_value(
        "colab_notebooks", {"repository": "", "branch": "gh-pages"}, "html"
    )
    app.connect("doctree-resolved", add_buttons)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
