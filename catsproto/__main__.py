"""`python -m catsproto` is the `catsproto` command."""

import sys

from catsproto.cli import main

sys.exit(main())
