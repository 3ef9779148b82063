"""``python -m tools.docs_reference [--check]``."""

import sys

from tools.docs_reference import main

sys.exit(main())
