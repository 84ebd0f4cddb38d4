"""The read side: a run's stores opened read-only, parameterised, time- and row-limited queries, runs and
ranks, and the findings computed across ranks. No Dash, no torch: tests and the command line use it."""
