"""Rewards: IRD, difference rewards, GRPO utilities and the TRL bridge. Not built yet."""
