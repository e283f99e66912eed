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


def max_score_error(data, got) -> float:
    """The largest |logged score - replayed score| over every step of ``data``'s episodes
    (asserting one replayed score per logged step)."""
    worst = 0.0
    for ep, g in zip(data["episodes"], got, strict=True):
        assert len(g) == len(ep["steps"])
        worst = max([worst] + [abs(s["score"] - x) for s, x in zip(ep["steps"], g, strict=True)])
    return worst
