"""`python -m specpage` is the `specpage` command."""

import sys

from specpage.cli import main

sys.exit(main())
