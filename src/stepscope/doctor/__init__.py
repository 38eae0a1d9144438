"""The doctor: from measured facts to a verdict and ranked fixes."""
