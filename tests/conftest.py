import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="session")
def ref_scenario():
    import libratio_jax as lj

    return lj.reference_scenario()


def data_path(*parts: str) -> str:
    """Path into tests/data (see tests/data/README.md for each file's origin)."""
    return os.path.join(DATA, *parts)
