"""Request sources: the trace type, loaders of trace formats, synthetic workloads."""
