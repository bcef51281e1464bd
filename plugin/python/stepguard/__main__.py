"""``python -m stepguard ...``: the ``stepguard`` command (stepguard._cli)."""

import sys

from ._cli import main

sys.exit(main())
