"""MkDocs hook for the tutorial pages (listed under ``hooks:`` in mkdocs.yml; not a page).

When the docs build executes the tutorials (``GNA_DOCS_EXECUTE=true``), plotly's default
renderer in a kernel writes only the ``application/vnd.plotly.v1+json`` output, which
mkdocs-jupyter does not render: the figures would be missing from the site. The ``notebook``
renderer also writes HTML with plotly.js inlined (no CDN), so the pages work offline. The kernels
inherit this environment variable; a value set by the caller wins.
"""

import os
from typing import Any


def on_config(config: Any) -> Any:
    os.environ.setdefault("PLOTLY_RENDERER", "notebook")
    return config
