"""The run store's writing side: the run directory, pure record builders, the writer thread and the
session that keeps a run's counters."""
