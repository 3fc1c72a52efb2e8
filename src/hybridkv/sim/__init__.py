"""Trace-driven simulation: traces, loaders, synthetic workloads, model shapes and replay."""
