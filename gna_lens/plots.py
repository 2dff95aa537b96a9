"""Interactive plotly figures of G&A results, and a static PNG export for the docs.

- :func:`head_heatmap`: a layer x head heatmap of one score of a :class:`~gna_lens.scoring.GnaReport`.
- :func:`sharpness_comparison`: sharpness of the top heads of several models, side by side.
- :func:`accuracy_vs_dictionary_size`: retrieval accuracy against the number of key-value pairs.
- :func:`save_png`: write a figure as a PNG (needs ``kaleido>=1`` and a Chrome or Chromium,
  see :func:`find_browser`).

Every function returns a ``plotly.graph_objects.Figure``; show it with ``fig.show()``, save it
interactive with ``fig.write_html(path, include_plotlyjs=True)`` (self-contained, works offline) or
static with :func:`save_png`.

The functions live in :mod:`gna_lens.render.plotly`, with every other rendered output of
gna_lens; this module is where users import them from.
"""

# The module's constants stay importable from here too (outside __all__, as before).
from gna_lens.render.plotly import ALIASES as ALIASES
from gna_lens.render.plotly import BROWSER_NAMES as BROWSER_NAMES
from gna_lens.render.plotly import REPORT_ATTRIBUTES as REPORT_ATTRIBUTES
from gna_lens.render.plotly import (
    accuracy_vs_dictionary_size,
    find_browser,
    head_heatmap,
    save_png,
    sharpness_comparison,
)

__all__ = [
    "accuracy_vs_dictionary_size",
    "find_browser",
    "head_heatmap",
    "save_png",
    "sharpness_comparison",
]
