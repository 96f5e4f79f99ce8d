"""Stage 5, across ranks: every rank's plan in, one reader per needed byte and its exchange out.

Choice and costs (``strategy``, ``costs``), the schedules (``schedule`` for replicated slices,
``stripes`` for striped reads), and the rounds that carry them out (``rounds``, ``exchange``,
``striped``).  The schedules are pure data computed on the coordinator; the exchange runs them
inside ``read_data``.
"""
