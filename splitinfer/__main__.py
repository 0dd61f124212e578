import sys

from splitinfer.cli import main

sys.exit(main())
