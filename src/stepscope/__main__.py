"""`python -m stepscope ...`: the same CLI as the `stepscope` command, for environments without its script."""

import sys

from stepscope.cli import main

sys.exit(main())
