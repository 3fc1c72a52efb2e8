"""The scheduler (request types, ``Scheduler``, admission orders) and the one drive loop."""
