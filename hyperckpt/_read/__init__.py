"""Stage 4, the bytes: a rank's read items in, its destinations filled out.

Sub-box geometry, coalesced positional reads, bounded staging, the load's statistics.
"""
