"""Links in the 404 page's text that work from any missing address.

sphinx-notfound-page serves one 404 page for every missing address, however deep, and makes the
theme's links and the page's images start at the site's root (``notfound_urls_prefix``). It
leaves the links in the page's own text relative, and they break one folder down. This makes
those internal links start at the site's root too.
"""

from docutils import nodes


def absolute_links(app, doctree, docname):
    if docname != app.config.notfound_pagename:
        return
    prefix = app.config.notfound_urls_prefix or "/"
    for reference in doctree.findall(nodes.reference):
        uri = reference.get("refuri", "")
        if reference.get("internal") and uri and not uri.startswith(("/", "#")):
            reference["refuri"] = prefix + uri


def setup(app):
    app.setup_extension("notfound.extension")
    app.connect("doctree-resolved", absolute_links)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
