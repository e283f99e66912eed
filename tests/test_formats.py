import numpy as np
import pytest

from libratio_jax.physics import formats as F


def test_storage_bits_published():
    # IEEE / OCP MX v1.0 / NVFP4: block scales included.
    bits = dict(zip(F.FORMAT_NAMES, F.STORAGE_BITS, strict=True))
    assert bits["fp32"] == 32 and bits["bf16"] == 16 and bits["fp16"] == 16
    assert bits["fp8_e4m3"] == 8 and bits["fp8_e5m2"] == 8 and bits["int8"] == 8
    assert bits["mxfp8"] == 8 + 8 / 32 and bits["mxfp4"] == 4 + 8 / 32
    assert bits["nvfp4"] == 4 + 8 / 16
    assert 4 < bits["nf4"] <= 4.5 and 4 < bits["int4"] <= 4.25


def test_float_limits_match_ml_dtypes():
    import ml_dtypes

    for name, dt in [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16),
                     ("fp8_e4m3", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2),
                     ("fp32", np.float32)]:
        info = ml_dtypes.finfo(dt)
        i = F.format_id(name)
        assert F.MAX_VALUE[i] == pytest.approx(float(info.max), rel=1e-6), name
        assert F.MIN_NORMAL[i] == pytest.approx(float(info.smallest_normal), rel=1e-6), name
        assert F.MANTISSA_BITS[i] == info.nmant, name
        # unit roundoff u = eps / 2
        assert F.UNIT_ROUNDOFF[i] == pytest.approx(float(info.eps) / 2), name


def test_e2m1_limits():
    import ml_dtypes

    info = ml_dtypes.finfo(ml_dtypes.float4_e2m1fn)
    for name in ("mxfp4", "nvfp4"):
        assert F.MAX_VALUE[F.format_id(name)] == float(info.max)
        assert F.MANTISSA_BITS[F.format_id(name)] == info.nmant


@pytest.mark.parametrize("name,expected", [("BF16", "bf16"), ("bf16", "bf16"),
                                           ("fp8_e4m3", "fp8_e4m3"), ("FP8-E4M3", "fp8_e4m3"),
                                           ("fp8", "fp8_e4m3"), ("float16", "fp16"),
                                           ("NVFP4", "nvfp4"), ("fp8e5m2", "fp8_e5m2")])
def test_parse_case_insensitive(name, expected):
    assert F.format_name(F.format_id(name)) == expected


def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError) as e:
        F.format_id("fp7")
    msg = str(e.value)
    assert "fp7" in msg and all(n in msg for n in F.FORMAT_NAMES)
    with pytest.raises(ValueError):
        F.format_id(99)
    with pytest.raises(ValueError):
        F.format_id(None)


def test_select_columns_equals_gather():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(F.NUM_FORMATS, 3)).astype(np.float32)
    ids = rng.integers(0, F.NUM_FORMATS, size=(5, 7))
    cols = F.select_columns(ids, table)
    for k in range(3):
        np.testing.assert_array_equal(np.asarray(cols[k]), table[ids, k])
