"""Auto-instrumentation of unmodified scripts: launcher, hooks, tracker, per-rank files, capture."""


class LaunchError(Exception):
    """The command could not be started (missing script, unknown launcher)."""
