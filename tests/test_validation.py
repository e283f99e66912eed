"""Every entry point that takes user data raises a ValueError naming the field (and the file),
before any tracing; the CLI turns it into one line and exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.cli import main
from libratio_jax.integrations.trl import build_dataset
from libratio_jax.physics import architecture as A
from libratio_jax.scenarios import ScenarioRecipe

QWEN = A.load_config_dict("Qwen2.5-0.5B")


@pytest.mark.parametrize("change,field", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, "must divide hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({"num_hidden_layers": "24"}, "num_hidden_layers must be an integer"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"model_type": "gpt2"}, "unsupported model_type"),
])
def test_model_configs_name_the_field(change, field):
    cfg = {**QWEN, **change}
    with pytest.raises(ValueError, match=field):
        lj.ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("text", ["[]", "null", "{not json", "", '"a string"'])
def test_config_files_name_the_file(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="config.json"):
        lj.ModelSpec.from_hf_config(str(path))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**QWEN, "num_attention_heads": 0}))
    with pytest.raises(ValueError, match="bad.json: config: num_attention_heads"):
        lj.ModelSpec.from_hf_config(str(bad))
    with pytest.raises(ValueError, match="bad.json"):
        lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8), [lj.Tenant(str(bad))])


@pytest.mark.parametrize("kw,field", [
    (dict(batch="8"), "workload.batch"), (dict(batch=1e30), "workload.batch"),
    (dict(batch=0), "workload.batch"), (dict(seq_len=2.5), "workload.seq_len"),
    (dict(priority=float("inf")), "workload.priority"),
    (dict(priority=float("nan")), "workload.priority"), (dict(priority=-1), "workload.priority"),
    (dict(slo_tokens_per_second=-5.0), "slo_tokens_per_second"),
    (dict(mode="infer"), "workload.mode"), (dict(optimizer="lion"), "workload.optimizer"),
])
def test_workloads_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        lj.Workload.make(**kw)


def test_tenants_clusters_and_scenarios():
    cluster = lj.ClusterSpec.uniform("H100-SXM", 8)
    with pytest.raises(ValueError, match="unknown fields"):
        lj.Scenario.build(cluster, [lj.Tenant("Qwen3-0.6B", {"batchsize": 8})])
    with pytest.raises(ValueError, match="tenants must be"):
        lj.Scenario.build(cluster, "Qwen3-0.6B")
    with pytest.raises(ValueError, match="ClusterSpec"):
        lj.Scenario.build({"H100-SXM": 8}, [lj.Tenant("Qwen3-0.6B")])
    with pytest.raises(ValueError, match="max_tenants"):
        lj.Scenario.build(cluster, [lj.Tenant("Qwen3-0.6B")], max_tenants=0)
    for pools, field in (({"H100-SXM": 0}, "gpu count"), ({"H100-SXM": "2"}, "gpu count"),
                         ({"H100-SXM": 2.5}, "gpu count"), ({"H9000": 2}, "unknown GPU kind"),
                         ([("H100-SXM",)], "pair"), ("H100-SXM", "pools must be")):
        with pytest.raises(ValueError, match=field):
            lj.ClusterSpec.mixed(pools)
    with pytest.raises(ValueError, match="inlet_celsius"):
        lj.ClusterSpec.uniform("H100-SXM", 2, inlet_celsius=float("nan"))


def test_plan_choices_are_strict():
    sc = lj.reference_scenario(block_groups=1)
    off = lj.Plan.from_choices(sc, [{"gpus": 2, "recompute": "false"}])
    assert int(off.recompute[0]) == 0
    with pytest.raises(ValueError, match="recompute"):
        lj.Plan.from_choices(sc, [{"gpus": 2, "recompute": "maybe"}])
    with pytest.raises(ValueError, match="gpus"):
        lj.Plan.from_choices(sc, [{"gpus": "2"}])


@pytest.mark.parametrize("kw,field", [
    (dict(batch="8"), "batch"), (dict(micro_batch=-1), "micro_batch"),
    (dict(micro_batch=0), "micro_batch"), (dict(pp=10**6), "pp"), (dict(gpus=0), "gpus"),
    (dict(zero_stage=4), "zero_stage"), (dict(recompute="maybe"), "recompute"),
    (dict(seq_len=float("nan")), "seq_len"), (dict(mode="infer"), "mode"),
])
def test_estimates_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        lj.estimate_memory("Llama-3.2-1B", **kw)


def test_estimate_reads_words_for_booleans():
    a = lj.estimate_memory("Llama-3.2-1B", recompute="false")
    assert a == lj.estimate_memory("Llama-3.2-1B", recompute=False)
    assert all(np.isfinite(v) and v >= 0 for v in a.as_dict().values())


def test_recipes_and_datasets():
    for text in ("", "[]", '{"pools": 1}', "{" * 10_000, '{"pools": [], "inlet_celsius": 1}'):
        with pytest.raises(ValueError, match="recipe"):
            ScenarioRecipe.from_json(text)
    for n in ("x", 0, -3, 2.5, None):
        with pytest.raises(ValueError, match="n"):
            build_dataset(n)


@pytest.mark.parametrize("argv,needle", [
    (["estimate-memory", "Llama-3.2-1B", "--micro-batch", "-1"], "micro_batch"),
    (["estimate-memory", "Llama-3.2-1B", "--pp", "1000000"], "pp"),
    (["estimate-memory", "Llama-3.2-1B", "--batch", "0"], "batch"),
    (["estimate-throughput", "Llama-3.2-1B", "--gpu", "H9000"], "unknown GPU kind"),
])
def test_cli_errors_are_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_names_a_bad_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("[]")
    with pytest.raises(SystemExit) as e:
        main(["estimate-memory", str(path)])
    assert e.value.code == 2 and "config.json" in capsys.readouterr().err
