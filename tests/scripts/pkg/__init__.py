"""A package holding a training module, run as ``stepscope run -m pkg.train``."""
