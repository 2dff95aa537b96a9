"""gna_lens: Gather-and-Aggregate interpretability for Transformers, SSMs and hybrids."""

from gna_lens.errors import GnaLensError

__version__ = "0.1.0"

__all__ = [
    "GnaLensError",
    "__version__",
]
