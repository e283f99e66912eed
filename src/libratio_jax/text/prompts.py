"""Chat prompts for the planning task: the system prompt (the task, the plan's JSON form and
the rules) and a scenario as chat messages.

    >>> from libratio_jax.scenarios import preset
    >>> msgs = scenario_messages(preset("small_fleet"))
    >>> [m["role"] for m in msgs]
    ['system', 'user']
"""

from __future__ import annotations

from libratio_jax.physics import formats as F
from libratio_jax.physics.plan import LAYER_GROUPS
from libratio_jax.text import codec as T

SYSTEM_PROMPT = f"""You plan how machine-learning jobs (tenants) share a GPU cluster. For every \
tenant choose the GPU pool and GPU count, tensor (tp) and pipeline (pp) parallelism, the ZeRO \
stage, activation recomputation, the micro-batch, the KV-cache format and the numeric format of \
each layer group.

Answer with one JSON object in a ```json code block, in this form:
{{"tenants": [{{"id": 0, "pool": 0, "gpus": 4, "tp": 2, "pp": 1, "zero_stage": 3, \
"recompute": true, "micro_batch": 1, "kv_precision": "bf16", "precision": {{"default": "bf16", \
"mlp": "fp8", "lm_head": "bf16"}}}}, ...]}}
Fields left out take these defaults: pool 0, gpus 1, tp 1, pp 1, zero_stage 0, recompute \
false, micro_batch 1, kv_precision "bf16", precision "bf16". "precision" is one format or a \
mapping from layer groups ({", ".join(g for g in LAYER_GROUPS if g not in ("moe_router",))}) \
to formats, with a "default".
Formats: {", ".join(F.FORMAT_NAMES)}.

Rules:
- A tenant runs on one pool; the tenants of a pool together get at most its GPUs.
- gpus must be a multiple of tp * pp; tp must divide the attention heads and the KV heads; \
pp must not exceed the blocks; zero_stage is 0 to 3.
- Every tenant's weights, gradients, optimizer state, activations and KV cache must fit in \
the memory of each of its GPUs.
- Low-precision formats save memory and can run faster (FP8 only on GPUs with FP8 tensor \
cores), but embeddings, norms, routers and the output head in FP8 or 4-bit formats make \
training diverge, and FP16 without scaling overflows.
- The score is the priority-weighted mean of each tenant's utility: throughput against its \
target, numerical stability and GPUs left free. A plan that starves a tenant of GPUs, runs \
out of memory, over-commits a pool or diverges, or puts every layer of a tenant in a 4-bit \
format scores 0.01."""




def scenario_messages(scenario, *, agent: int | None = None,
                      context_plan: str | None = None) -> list[dict[str, str]]:
    """Chat messages for one scenario: ``[{"role": "system", ...}, {"role": "user", ...}]``.

    ``agent``: the model plans only this tenant; ``context_plan`` (JSON text) holds the other
    tenants' fixed plans, shown in the prompt.
    """
    user = T.render_scenario(scenario)
    if agent is None:
        user += "\n\nWrite the plan for every tenant."
    else:
        user += (f"\n\nYou plan tenant {agent} only; the other tenants keep these plans:\n"
                 f"{context_plan}\nWrite the plan for tenant {agent} "
                 f'(as {{"tenants": [{{"id": {agent}, ...}}]}}).')
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def chat_prompt(messages: list[dict[str, str]], tokenizer) -> str:
    """The prompt text of ``messages`` through ``tokenizer``'s chat template, ready for
    generation (``add_generation_prompt=True``)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
