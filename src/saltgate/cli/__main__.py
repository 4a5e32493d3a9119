"""`python -m saltgate.cli`."""

import sys

from saltgate.cli import main

sys.exit(main())
