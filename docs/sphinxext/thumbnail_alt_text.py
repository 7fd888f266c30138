"""Alt text for the gallery's thumbnails.

sphinx-gallery leaves each thumbnail's alt text empty. A thumbnail shows its example's first
figure, so it gets that figure's alt text, which says what the figure shows. Works on doctree
image nodes: thumbnails wherever they appear (the gallery, mini-galleries, related examples),
and the first figure of each example page.
"""

import re

from docutils import nodes

# A thumbnail's path names its gallery folder and its example: <gallery>/images/thumb/...
THUMBNAIL = re.compile(r"([\w/]+)/images/thumb/sphx_glr_(\w+)_thumb\.(?:png|svg)$")
FIGURE_CLASSES = {"sphx-glr-single-img", "sphx-glr-multi-img"}
NOT_RUN = "Placeholder: this build did not run the example"


def first_figure_alt(doctree):
    for image in doctree.findall(nodes.image):
        if FIGURE_CLASSES & set(image["classes"]) and image.get("alt"):
            return image["alt"]
    return None


def describe_thumbnails(app, doctree, docname):
    for image in doctree.findall(nodes.image):
        match = THUMBNAIL.search(image["uri"])
        if match is None:
            continue
        example = f"{match.group(1).strip('/')}/{match.group(2)}"
        alt = None
        if example in app.env.found_docs:
            alt = first_figure_alt(app.env.get_doctree(example))
        image["alt"] = alt or NOT_RUN  # make html-noplot: the example did not run


def setup(app):
    app.connect("doctree-resolved", describe_thumbnails)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
