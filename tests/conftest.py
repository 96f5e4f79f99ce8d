"""Shared test configuration: hypothesis profiles."""

from __future__ import annotations

import os

import pytest
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


#: Seconds before pytest-timeout stops a test that spawns ranks: past the rank harness's own
#: limits (a stall of two minutes, a wall-clock cap of 15), so a slow run on a busy machine
#: ends by the harness's report, and only a harness that itself hangs meets this one.
SPAWNING_TEST_TIMEOUT = 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("distributed") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SPAWNING_TEST_TIMEOUT))


# The local S3-compatible server and the environment that points clients at it.
from s3faults import s3_env, s3_server  # noqa: E402, F401
