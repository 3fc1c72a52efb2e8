"""Executors: one process pool and one Ray wrapper, used by replay --jobs, sweep, cluster."""
