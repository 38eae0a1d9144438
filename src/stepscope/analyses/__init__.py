"""Analyses: pure functions over measured data (parameter audit, and later loader ceiling, traces)."""
