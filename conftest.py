"""Collection set-up for the doctests under gna_lens/ (tests/conftest.py covers tests/)."""

import importlib.util

# gna_lens.lm_eval needs the optional extra gna-lens[lmeval]; without lm-eval its doctests
# cannot even be imported (tests/test_lm_eval.py skips itself the same way).
collect_ignore_glob = [] if importlib.util.find_spec("lm_eval") else ["gna_lens/lm_eval/*"]
