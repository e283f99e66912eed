import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")


@pytest.fixture(scope="session")
def ref_scenario():
    import libratio_jax as lj

    return lj.reference_scenario()


def shared_path(*parts: str) -> str:
    """Path into ../shared (the test vectors beside the checkout)."""
    return os.path.join(SHARED, *parts)
