"""`python -m xrec ...`: the same as the `xrec` command."""

import sys

from xrec.cli import main

sys.exit(main())
