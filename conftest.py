"""Collection set-up for the doctests under gna_lens/ (tests/conftest.py covers tests/)."""

import importlib.util

# gna_lens.lm_eval needs the optional extra gna-lens[lmeval]; without lm-eval its doctests
# cannot even be imported (tests/test_lm_eval.py skips itself the same way).
collect_ignore_glob = [] if importlib.util.find_spec("lm_eval") else ["gna_lens/lm_eval/*"]

# The run-time type checker named in pyproject.toml's --jaxtyping-packages: jaxtyping reaches it
# as an attribute of the package `tests`, so the submodule is imported here, before any test
# imports gna_lens (and before jaxtyping's import hook instruments it).
import tests.typecheck  # noqa: E402, F401
