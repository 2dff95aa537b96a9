"""Where every rendered output of gna_lens lives: the HTML report, SVG figures, markdown tables
and plotly figures.

The data classes (:class:`~gna_lens.scoring.GnaReport`, :class:`~gna_lens.scoring.KnowledgeTable`,
:class:`~gna_lens.interventions.result.CellResult`, the lm-eval and hybrid tables, the
distillation result) hold data; their ``to_html``, ``to_svg``, ``to_markdown``, ``figure`` and
``plot`` methods are one-line calls into this package. A render function takes the data object
and reads its attributes (duck typing): it never imports the object's class, so this library
package never imports an application (the hybrid experiment, the lm-eval table, the findings
run) nor a package above it, and the classes can import it freely.

Importing this package imports none of its modules; plotly, pandas and circuitsvis are imported
inside the functions that need them.
"""
