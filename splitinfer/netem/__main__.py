"""``python -m splitinfer.netem``: the same as ``splitinfer netem``."""

import sys

from splitinfer.netem.cli import main

sys.exit(main())
