import json

import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import architecture as A

PUBLISHED_TOTALS = {  # issue 6 / model cards
    "Llama-3.1-8B": 8_030_261_248,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Mixtral-8x7B": 46_702_792_704,
}


def _transformers_count(cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(cfg)
    cfg_obj = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg_obj)
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("name", A.catalog_models())
def test_param_count_exact_vs_transformers(name):
    cfg = A.load_config_dict(name)
    spec = lj.ModelSpec.from_hf_config(name)
    assert spec.total_params == _transformers_count(cfg)


@pytest.mark.parametrize("name,total", sorted(PUBLISHED_TOTALS.items()))
def test_published_totals(name, total):
    assert lj.ModelSpec.from_hf_config(name).total_params == total


def test_moe_active_params():
    q = lj.ModelSpec.from_hf_config("Qwen3-30B-A3B")
    assert 3.2e9 < q.active_params < 3.4e9  # "A3B": ~3.3 B active
    m = lj.ModelSpec.from_hf_config("Mixtral-8x7B")
    assert 12.8e9 < m.active_params < 13.0e9  # Mixtral paper: 12.9 B active


def test_sources_config_path_and_pretrained_config(tmp_path):
    from transformers import AutoConfig

    cfg = A.load_config_dict("Qwen2.5-0.5B")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    a = lj.ModelSpec.from_hf_config(str(path))
    b = lj.ModelSpec.from_hf_config(tmp_path)
    d = dict(cfg)
    c = lj.ModelSpec.from_hf_config(AutoConfig.for_model(d.pop("model_type"), **d))
    assert a.total_params == b.total_params == c.total_params == 494_032_768


def test_rows_structure_qwen3_and_ties():
    spec = lj.ModelSpec.from_hf_config("Qwen3-0.6B")  # tied, q/k norms, head_dim 128 != 1024/16
    names = spec.row_names()
    assert names[0] == "embedding" and names[-1] == "lm_head"
    kinds = np.asarray(spec.kind)[: int(spec.n_rows)]
    params = np.asarray(spec.params)
    assert params[int(spec.n_rows) - 1] == 0  # tied lm_head stores nothing
    assert np.asarray(spec.flops_per_token)[int(spec.n_rows) - 1] == 2 * 1024 * 151936
    per_block = np.sum(np.asarray(spec.block) == 0)
    assert per_block == 11  # 2 norms + q,k,v,o + q_norm,k_norm + gate,up,down
    assert (kinds == A.NORM).sum() == 28 * 4 + 1
    assert int(spec.head_dim) == 128 and int(spec.hidden) == 1024


def test_qwen2_qkv_bias():
    spec = lj.ModelSpec.from_hf_config("Qwen2.5-7B")
    p = np.asarray(spec.params)
    # q: 3584*3584 + 3584 bias; k, v: 3584*512 + 512; o: no bias
    assert p[2] == 3584 * 3584 + 3584 and p[3] == 3584 * 512 + 512
    assert p[5] == 3584 * 3584


def test_padding_and_capacity():
    spec = lj.ModelSpec.from_hf_config("tiny-llama", capacity=64)
    assert spec.capacity == 64 and int(np.sum(np.asarray(spec.valid))) == int(spec.n_rows)
    assert spec.total_params == lj.ModelSpec.from_hf_config("tiny-llama").total_params
    with pytest.raises(ValueError):
        lj.ModelSpec.from_hf_config("Llama-3.1-8B", capacity=10)


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen3-30B-A3B", "Qwen2.5-0.5B"])
@pytest.mark.parametrize("groups", [1, 3, 8])
def test_block_groups_preserve_totals(name, groups):
    full = lj.ModelSpec.from_hf_config(name)
    merged = lj.ModelSpec.from_hf_config(name, block_groups=groups)
    assert merged.total_params == full.total_params
    assert merged.active_params == full.active_params
    for f in ("flops_per_token", "act_bytes_per_token", "gemm_instances", "count"):
        a = np.asarray(getattr(full, f), np.float64)[np.asarray(full.valid)]
        b = np.asarray(getattr(merged, f), np.float64)[np.asarray(merged.valid)]
        if f == "count":
            a = a[np.asarray(full.block)[np.asarray(full.valid)] >= 0]
            b = b[np.asarray(merged.block)[np.asarray(merged.valid)] >= 0]
        assert a.sum() == pytest.approx(b.sum(), rel=1e-6), f
    assert int(merged.n_rows) < int(full.n_rows)


def test_unsupported_model_type():
    with pytest.raises(ValueError, match="unsupported model_type"):
        lj.ModelSpec.from_hf_config({"model_type": "gpt2", "hidden_size": 8})
    with pytest.raises(ValueError, match="catalog"):
        lj.ModelSpec.from_hf_config("no-such-model")


def test_model_directory_through_autoconfig(tmp_path):
    """A saved model's directory (as ``save_pretrained`` writes it) is read by
    ``transformers.AutoConfig`` offline; a folder without a config names itself."""
    from transformers import AutoConfig

    d = dict(A.load_config_dict("Qwen3-0.6B"))
    AutoConfig.for_model(d.pop("model_type"), **d).save_pretrained(tmp_path / "model")
    spec = lj.ModelSpec.from_hf_config(tmp_path / "model")
    assert spec.total_params == lj.ModelSpec.from_hf_config("Qwen3-0.6B").total_params
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        lj.ModelSpec.from_hf_config(tmp_path / "empty")
