"""``python -m extproc`` is the ``extproc`` command."""

import sys

from extproc.cli import main

sys.exit(main())
