"""Text for LLMs: the plan <-> JSON text codec with its never-raising parser (``codec``), chat
prompts (``prompts``), batched judging of completions (``judge``), the physics' feedback
(``feedback``), the text tasks of every environment (``task``, ``fleet_task``,
``classic_tasks``) and multi-turn sessions stepped in batches (``session``). No TRL import."""
