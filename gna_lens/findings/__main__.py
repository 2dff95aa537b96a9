"""``python -m gna_lens.findings``."""

import sys

from gna_lens.findings import main

sys.exit(main())
