"""Shared test configuration: hypothesis profiles."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# ci: derandomized and bounded, so CI is repeatable; fuzz: long local runs
# (HYPOTHESIS_PROFILE=fuzz python -m pytest tests/property).
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "fuzz",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
