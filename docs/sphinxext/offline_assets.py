"""No third-party scripts on the execution-times pages.

sphinx-gallery's execution-times pages load jQuery, DataTables and Bootstrap from CDNs through
a ``raw`` HTML block. The site loads nothing from third parties, so this drops the ``raw`` nodes
from those pages' doctrees; the table itself is ordinary reST and stays. A page that still
refers to another host afterwards fails the build.
"""

from docutils import nodes
from sphinx.errors import ExtensionError


def drop_cdn_assets(app, doctree):
    docname = app.env.docname
    if not docname.endswith("sg_execution_times"):
        return
    for raw in list(doctree.findall(nodes.raw)):
        raw.parent.remove(raw)
    remote = [
        ref["refuri"]
        for ref in doctree.findall(nodes.reference)
        if ref.get("refuri", "").startswith(("http://", "https://", "//"))
        and ref["refuri"].endswith((".js", ".css"))
    ]
    if remote:
        raise ExtensionError(f"{docname}: still loads {remote}")


def setup(app):
    app.connect("doctree-read", drop_cdn_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
