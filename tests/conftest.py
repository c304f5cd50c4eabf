"""Hypothesis profiles. ``ci`` (the default) keeps the whole suite fast on two cores; pick another
with ``HYPOTHESIS_PROFILE=thorough pytest`` (or ``--hypothesis-profile thorough``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    print_blob=True,
    # Snapshot trees are built from many small draws; a loaded CI machine must not fail on that.
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def dynamo() -> Iterator[Any]:
    """dynamo's counters, from a reset: what a test compiles, and nothing left for the next."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()
