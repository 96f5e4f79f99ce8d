"""Stage 5, across ranks: every rank's plan in, one reader per shared slice and its exchange out.

The schedule is pure data computed on the coordinator; the exchange runs it inside ``read_data``.
"""
