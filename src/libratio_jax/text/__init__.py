"""Text for LLMs: the plan <-> JSON text codec with its never-raising parser (``codec``), chat
prompts (``prompts``) and batched judging of completions (``judge``). No TRL import."""
