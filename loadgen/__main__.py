"""`python -m loadgen run|sweep|report|selfcheck`."""

import sys

from loadgen.cli import main

sys.exit(main())
