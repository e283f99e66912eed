"""Multi-turn GRPO with TRL: the model plays Fleet episodes round after round through a tool.

    python experiments/trl_multiturn.py                    # tiny local model, CPU, ~1 minute
    python experiments/trl_multiturn.py --model /path/to/Qwen3-0.6B --steps 100 \\
        --max-completion-length 4096 --bf16                # a local HF chat model with tools

``GRPOTrainer(environment_factory=...)`` gives every rollout a
:class:`~libratio_jax.integrations.trl_env.FleetEnvironment`: ``reset`` appends the scenario to
the prompt, the model calls ``submit_plan(plan)`` as often as it likes (each call is one round
of the episode, judged by the physics, answered with the feedback and the cluster's next
state), and the rollout's reward is the episode's mean team reward (``get_reward``).

Without ``--model`` the script builds here (no downloads) a tokenizer with TRL's Qwen3 chat
template (tool calls and responses) whose vocabulary holds a few whole tool calls (each
submitting a plan for one of the prompts' scenarios) as single tokens, and a tiny random
Llama: a random policy then calls the tool now and then. It checks the pipeline; it is not a
language model.

Writes ``experiments/results/trl_multiturn.json`` (per-step reward, tool-call and tool-failure
frequencies, every scored rollout's rounds and reward, whether the weights changed, settings,
versions).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, result_path, save_json  # noqa: E402


def tiny_model(factory, rows, calls_per_prompt: int):
    """A tool-calling tokenizer (with whole ``submit_plan`` calls as tokens: the greedy plan and
    random valid plans of each row's scenario) and the tiny Llama."""
    import jax
    import jax.numpy as jnp

    from libratio_jax.agents.policies import greedy_plan, random_valid_plan
    from libratio_jax.integrations.tiny_lm import (
        build_tiny_llama,
        build_tool_tokenizer,
        tool_call_text,
    )
    from libratio_jax.text import codec as T

    greedy, sample = jax.jit(greedy_plan), jax.jit(random_valid_plan)
    corpus = [m["content"] for r in rows for m in r["prompt"]]
    calls = []
    env = factory()
    for k, r in enumerate(rows):
        corpus.append(env.reset(seed=r["seed"]))
        sc = jax.tree.map(jnp.asarray, env.scenario)
        plans = [greedy(sc)] + [sample(jax.random.PRNGKey(100 * k + j), sc)
                                for j in range(calls_per_prompt - 1)]
        for plan in plans:
            text = T.render_plan(sc, plan)
            calls.append(tool_call_text("submit_plan", plan=text))
        corpus.append(env.submit_plan(T.render_plan(sc, plans[0])))  # feedback, for the BPE
    tok = build_tool_tokenizer(corpus, call_tokens=calls)
    return build_tiny_llama(tok, max_positions=8192), tok


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF chat model folder (default: tiny)")
    ap.add_argument("--env", default="Fleet-easy-v0", help="a registered Fleet-* env")
    ap.add_argument("--bank-size", type=int, default=16, help="scenarios in the env's bank")
    ap.add_argument("--prompts", type=int, default=8, help="episodes (dataset rows)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="rollouts per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=512)
    ap.add_argument("--max-tool-calls", type=int, default=4, help="tool rounds per rollout")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-2 tiny, 1e-6 --model")
    ap.add_argument("--calls-per-prompt", type=int, default=3, help="tool-call tokens (tiny)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libratio_jax.integrations import trl_env

    rewarded: list[tuple[int, float]] = []  # (rounds, reward) of every rollout TRL scored

    class RecordedFleetEnvironment(trl_env.FleetEnvironment):
        def get_reward(self) -> float:
            reward = super().get_reward()
            rewarded.append((self.rounds, reward))
            return reward

    t_start = time.perf_counter()
    factory = trl_env.environment_factory(args.env, bank_size=args.bank_size,
                                                seed=args.seed, cls=RecordedFleetEnvironment)
    rows = trl_env.session_dataset(args.prompts, seed=args.seed)
    if args.model:
        from trl.chat_template_utils import add_response_schema

        tok = add_response_schema(AutoTokenizer.from_pretrained(args.model))
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
        lr = args.lr or 1e-6
    else:
        model, tok = tiny_model(factory, rows, args.calls_per_prompt)
        lr = args.lr or 1e-2
    rewarded.clear()  # (building the tiny tokenizer played one episode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_multiturn_"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calls, learning_rate=lr, logging_steps=1,
        report_to="none", save_strategy="no", seed=args.seed, bf16=args.bf16,
        use_cpu=not torch.cuda.is_available())
    trainer = trl.GRPOTrainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_list(rows),
                              processing_class=tok, environment_factory=factory)
    trainer.train()

    key = f"rewards/{RecordedFleetEnvironment.__name__}/mean"
    log = [{"step": h["step"], "reward": h[key],
            "tool_call_frequency": h.get("tools/call_frequency"),
            "tool_failure_frequency": h.get("tools/failure_frequency"),
            "completion_length": h.get("completions/mean_length")}
           for h in trainer.state.log_history if key in h]
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary = {
        "experiment": "trl_multiturn", "model": args.model or "tiny-llama (local, random init)",
        "device_kind": device, "env": args.env, "steps": trainer.state.global_step,
        "rollouts_per_step": args.batch, "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length, "learning_rate": lr,
        "rollouts": trainer.state.global_step * args.batch,
        "rollouts_rewarded": len(rewarded),
        "rollout_rounds": [n for n, _ in rewarded],
        "rollout_rewards": [round(r, 4) for _, r in rewarded],
        "weights_changed": changed,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "trl_version": trl.__version__, "log": log,
    }
    path = save_json(result_path("trl_multiturn", "json", out_dir), summary)
    print({k: v for k, v in summary.items() if k not in ("log", "rollout_rounds",
                                                         "rollout_rewards")}, "->", path)
    return summary


if __name__ == "__main__":
    main()
