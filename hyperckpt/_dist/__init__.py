"""Across ranks, for every stage: ranks agreeing on a refusal, headers read once and shared,
and the harness that spawns CPU ranks (demo and tests).

Nothing here plans or reads a checkpoint's bytes; the stages above call it where ranks must
act together.
"""
