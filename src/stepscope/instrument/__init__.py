"""Auto-instrumentation of unmodified scripts: launcher, hooks, tracker, per-rank files, capture."""


class LaunchError(Exception):
    """The command could not be started (missing script, unknown launcher)."""


# The options of following a run's steps (follow.py), here so that the command line reads them without importing it.
HANG_AFTER = 20.0  # no step for this many median steps is a stall (``--hang-after``) ...
MIN_HANG_S = 10.0  # ... and for at least this long: a pause of seconds (a checkpoint save) is not one
PROGRESS_MODES = ("auto", "live", "plain", "none")

# The stack sampler's rates (collectors/stacks.py), here so that the command line reads them without importing it.
DEFAULT_STACK_HZ = 100.0
MAX_STACK_HZ = 1000.0

# The prefix of the phase ranges the capture writes (profile.py), here so that the trace analysis reads it without
# importing the capture (and logging).
RANGE_PREFIX = "stepscope/"
