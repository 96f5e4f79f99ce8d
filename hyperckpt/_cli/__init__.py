"""The ``hyperckpt`` command: inspect, validate, plan and demo on top of the public API.

Also the dry-run planning, the built-in sample and the spawned CPU ranks the demo and tests use.
"""
