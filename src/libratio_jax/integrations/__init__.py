"""Bridges to other libraries: TRL's ``GRPOTrainer`` (``trl``: datasets and reward functions)
and a tiny local Llama for tests (``tiny_lm``). Their heavy dependencies are optional extras
(``pip install 'libratio_jax[hf]'``)."""
