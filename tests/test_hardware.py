import numpy as np
import pytest

from libratio_jax.physics import formats as F
from libratio_jax.physics.hardware import GPU_CATALOG, ClusterSpec, gpu_spec


def test_catalog_has_required_kinds():
    for k in ("H100-SXM", "H100-PCIe", "H200", "A100-80GB", "B200", "L40S", "MI300X"):
        assert k in GPU_CATALOG


def test_spec_sheet_values():
    h100 = gpu_spec("h100-sxm")
    # H100 SXM datasheet: 3.35 TB/s; 989.5 dense BF16 (1979 sparse), FP8 2x BF16; 700 W.
    assert h100.hbm_bytes_per_second == 3.35e12
    assert h100.peak_flops[F.CC_BF16] == pytest.approx(1979e12 / 2)
    assert h100.peak_flops[F.CC_FP8] == pytest.approx(2 * h100.peak_flops[F.CC_BF16])
    assert h100.tdp_watts == 700
    assert 79 * 2**30 < h100.hbm_bytes < 80 * 2**30
    assert gpu_spec("A100-80GB").peak_flops[F.CC_BF16] == pytest.approx(312e12)
    assert gpu_spec("A100-80GB").peak_flops[F.CC_FP8] == 0  # no FP8 on Ampere
    assert gpu_spec("H200").hbm_bytes_per_second == 4.8e12
    assert gpu_spec("MI300X").peak_flops[F.CC_BF16] == pytest.approx(1307.4e12)
    assert gpu_spec("B200").peak_flops[F.CC_FP4] == pytest.approx(2 * gpu_spec(
        "B200").peak_flops[F.CC_FP8])
    for s in GPU_CATALOG.values():
        assert 0 < s.idle_watts < s.tdp_watts
        assert s.slowdown_celsius < s.shutdown_celsius
        # dense numbers: FP8 never more than twice BF16, TF32 half of BF16
        assert s.peak_flops[F.CC_FP8] <= 2 * s.peak_flops[F.CC_BF16] * 1.001


def test_unknown_gpu():
    with pytest.raises(ValueError, match="H100-SXM"):
        gpu_spec("V100")


def test_mixed_cluster_padding():
    c = ClusterSpec.mixed({"H100-SXM": 8, "A100-80GB": 4}, pool_capacity=3)
    assert c.num_pools == 3
    assert int(c.total_gpus) == 12
    np.testing.assert_array_equal(np.asarray(c.valid), [True, True, False])
    with pytest.raises(ValueError):
        ClusterSpec.mixed({"H100-SXM": 0})
    with pytest.raises(ValueError):
        ClusterSpec.mixed({"H100-SXM": 8, "H200": 8}, pool_capacity=1)
