"""Stage 3, what each rank needs: DTensor placements in, the disjoint global regions it holds out.

The region arithmetic (``_StridedShard`` included) and the DCP load planner built on it.
"""
