"""`python -m stepscope ...`: the same CLI as the `stepscope` command, for environments without its script."""

from stepscope.cli import entry_point

entry_point()
