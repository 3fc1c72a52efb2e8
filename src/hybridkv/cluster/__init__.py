"""Multi-instance replay (``hybridkv cluster``): N instances, each its own manager, pool and
scheduler, behind a router that sees only what a real router sees — load reports and the
instances' KV events.

Modules: ``instance`` (one instance, driven in epochs), ``routers`` (round-robin, session
affinity, least-loaded), ``prefix`` (event-fed prefix indexes and their routers),
``simulate`` (time model, dispatch, load accounting), ``backends`` (``--jobs`` processes,
``--ray`` actors), ``report`` (table, JSON, plot), ``command`` (the CLI command).
"""
