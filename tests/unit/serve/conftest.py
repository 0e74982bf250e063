"""The server tests' engine: one per module, since a module's servers (uvicorn threads, clients) are
started once on it."""

import pytest
from conftest import make_tiny_engine


@pytest.fixture(scope="module")
def engine():
    """One ``make_tiny_engine()`` per module: its cache and counters carry over between the module's
    tests, so a test that reads them compares before and after."""
    return make_tiny_engine()
