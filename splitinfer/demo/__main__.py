"""``python -m splitinfer.demo``: the same as ``splitinfer demo``."""

import sys

from splitinfer.demo.cli import main

sys.exit(main())
