"""Sweeps: cells (trace × model × pool × policy × admission), the result store, the run."""
