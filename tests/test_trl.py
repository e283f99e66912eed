"""End to end: TRL's GRPOTrainer trains a tiny Llama (built here, no downloads) for 2 steps on
our dataset with our reward functions, on the CPU."""

import jax
import numpy as np
import pytest

from libratio_jax.agents.policies import greedy_plan, random_valid_plan
from libratio_jax.integrations import trl as hf
from libratio_jax.integrations.tiny_lm import build_tiny_llama, build_tokenizer, corpus_of
from libratio_jax.scenarios import ScenarioRecipe
from libratio_jax.text import codec as T


class Spy:
    """Wraps a reward function and records every call (TRL logs it under the same name)."""

    def __init__(self, f):
        self.f, self.__name__, self.calls = f, f.__name__, []

    def __call__(self, prompts, completions, **kwargs):
        out = self.f(prompts, completions, **kwargs)
        self.calls.append((list(completions), list(kwargs["scenario"]), out))
        return out


def test_grpo_trainer_two_steps_on_cpu(tmp_path):
    # (imported here, not at collection: only the process that runs this test loads them)
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    rows = hf.build_dataset(4, seed=0, difficulty="easy")
    plan_texts = []
    greedy, sample = jax.jit(greedy_plan), jax.jit(random_valid_plan)  # (eager: op by op)
    for r in rows:  # whole plans as single tokens: a random model then emits valid plans
        sc = ScenarioRecipe.from_json(r["scenario"]).build()
        plan_texts.append(T.render_plan(sc, greedy(sc)))
        plan_texts += [T.render_plan(sc, sample(jax.random.PRNGKey(k), sc)) for k in range(3)]
    tok = build_tokenizer(corpus_of(rows), plan_tokens=plan_texts)
    model = build_tiny_llama(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spies = [Spy(f) for f in hf.make_reward_funcs(credit=True)]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=12, learning_rate=1e-2, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=spies, args=args,
                              train_dataset=hf.build_dataset(4, seed=0, difficulty="easy",
                                                             as_dataset=True),
                              processing_class=tok)
    trainer.train()

    assert trainer.state.global_step == 2
    physics = spies[0]
    for spy in spies:
        assert len(spy.calls) == 2  # once per step, on every completion of the step
        for completions, _, out in spy.calls:
            assert len(completions) == len(out) == 8 and np.isfinite(out).all()
    # the rewards TRL got are the engine's, recomputed independently of the trainer
    check = hf.make_reward_funcs(credit=True)
    for k, spy in enumerate(spies):
        for completions, scen, out in spy.calls:
            assert out == check[k](None, completions, scenario=scen)
    valid = [x > hf.DEFAULT_FORMAT_PENALTY for _, _, out in physics.calls for x in out]
    assert 0 < sum(valid) < len(valid)  # some completions were plans, some not
    logged = [h for h in trainer.state.log_history if "rewards/libratio_physics_reward/mean" in h]
    assert len(logged) == 2 and all("libratio/valid_fraction" in h for h in logged)
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    assert changed, "the policy did not change: no GRPO step was taken"
