"""GRPO with TRL's GRPOTrainer on our prompts and reward functions; logs and plots the reward.

    python experiments/trl_grpo.py                       # tiny local model, CPU, ~1 minute
    python experiments/trl_grpo.py --model /path/to/Qwen2.5-0.5B-Instruct --steps 200 \\
        --max-completion-length 512 --bf16               # any local HF causal LM, on a GPU

Without ``--model`` the script builds a tokenizer and a tiny random Llama here (no downloads,
``libratio_jax.integrations.tiny_lm``) whose vocabulary holds a few whole plans as single tokens,
so that even a random policy sometimes writes a valid plan; GRPO then raises the reward by
learning which plans suit which prompt. It checks the pipeline; it is not a language model.
With ``--model`` a real instruction model reads the rendered scenario and writes JSON.

Writes ``experiments/results/trl_grpo.json`` (per-step rewards, valid fraction, IRD rates,
settings, wall time, device) and ``trl_grpo.png`` (reward over steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, plot_lines, result_path, save_json  # noqa: E402


def tiny_model(rows, n_plan_tokens: int):
    """The tiny Llama and a tokenizer with ``n_plan_tokens`` plan tokens per prompt."""
    import jax

    from libratio_jax.agents.policies import greedy_plan, random_valid_plan
    from libratio_jax.integrations.tiny_lm import build_tiny_llama, build_tokenizer, corpus_of
    from libratio_jax.scenarios import ScenarioRecipe
    from libratio_jax.text import codec as T

    greedy, sample = jax.jit(greedy_plan), jax.jit(random_valid_plan)
    plans = []
    for k, r in enumerate(rows):
        sc = ScenarioRecipe.from_json(r["scenario"]).build()
        plans.append(T.render_plan(sc, greedy(sc)))
        plans += [T.render_plan(sc, sample(jax.random.PRNGKey(100 * k + j), sc))
                  for j in range(n_plan_tokens - 1)]
    tok = build_tokenizer(corpus_of(rows), plan_tokens=plans)
    return build_tiny_llama(tok), tok


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF model folder (default: tiny)")
    ap.add_argument("--difficulty", default="easy", choices=["easy", "medium", "hard",
                                                             "presets"])
    ap.add_argument("--prompts", type=int, default=8, help="distinct scenarios")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="completions per step")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=12)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-2 tiny, 1e-6 --model")
    ap.add_argument("--credit", action="store_true", help="add the difference reward")
    ap.add_argument("--agents", default="joint", choices=["joint", "each"])
    ap.add_argument("--plan-tokens", type=int, default=4, help="per prompt (tiny model)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)

    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libratio_jax.integrations import trl as hf

    t_start = time.perf_counter()
    rows = hf.build_dataset(args.prompts, seed=args.seed, difficulty=args.difficulty,
                            agents=args.agents)
    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
        lr = args.lr or 1e-6
    else:
        model, tok = tiny_model(rows, args.plan_tokens)
        lr = args.lr or 3e-2
    dataset = hf.build_dataset(args.prompts, seed=args.seed, difficulty=args.difficulty,
                               agents=args.agents, as_dataset=True)
    funcs = hf.make_reward_funcs(credit=args.credit, dataset=rows)
    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, learning_rate=lr,
        logging_steps=1, report_to="none", save_strategy="no", seed=args.seed,
        bf16=args.bf16, use_cpu=not torch.cuda.is_available(),
        reward_weights=[1.0, 0.5] + ([1.0] if args.credit else []))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=funcs, args=cfg,
                              train_dataset=dataset, processing_class=tok)
    trainer.train()

    steps = [h for h in trainer.state.log_history if "rewards/libratio_physics_reward/mean" in h]
    log = [{"step": h["step"],
            "physics_reward": h["rewards/libratio_physics_reward/mean"],
            "format_reward": h["rewards/libratio_format_reward/mean"],
            "valid_fraction": h.get("libratio/valid_fraction"),
            "ird_starved": h.get("libratio/ird_starved"),
            "ird_out_of_memory": h.get("libratio/ird_out_of_memory"),
            "completion_length": h.get("completions/mean_length")} for h in steps]
    first = sum(x["physics_reward"] for x in log[:5]) / max(len(log[:5]), 1)
    last = sum(x["physics_reward"] for x in log[-5:]) / max(len(log[-5:]), 1)
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    summary = {
        "experiment": "trl_grpo", "model": args.model or "tiny-llama (local, random init)",
        "device_kind": device, "difficulty": args.difficulty, "prompts": args.prompts,
        "steps": args.steps, "completions_per_step": args.batch,
        "num_generations": args.num_generations, "learning_rate": lr,
        "physics_reward_first5": round(first, 4), "physics_reward_last5": round(last, 4),
        "wall_seconds": round(time.perf_counter() - t_start, 1), "trl_version": trl.__version__,
        "log": log,
    }
    path = save_json(result_path("trl_grpo", "json", out_dir), summary)
    plot_lines(result_path("trl_grpo", "png", out_dir), {
        "physics reward (mean)": ([x["step"] for x in log], [x["physics_reward"] for x in log]),
        "valid fraction": ([x["step"] for x in log], [x["valid_fraction"] for x in log]),
    }, xlabel="GRPO step", ylabel="reward / fraction",
        title=f"TRL GRPOTrainer, {summary['model']}, {device}")
    print({k: v for k, v in summary.items() if k != "log"}, "->", path)
    return summary


if __name__ == "__main__":
    main()
