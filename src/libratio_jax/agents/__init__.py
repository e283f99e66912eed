"""Agents that act in the environments: reference policies (random, greedy), the factorized
plan space policies sample from, batched CEM search, and GRPO pieces in JAX."""
