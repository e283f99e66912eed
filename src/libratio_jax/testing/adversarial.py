"""Adversarial completion texts: shapes that make naive parsers super-linear (backtracking
regular expressions, rescans from every bracket). Used by the hardening tests (time grows
linearly) and by ``benchmarks/reward_latency.py`` (the worst 32 KB completion's latency).

    >>> len(SHAPES["open_braces"](1024))
    1024
"""

from __future__ import annotations

from collections.abc import Callable

# name -> a text of about n characters
SHAPES: dict[str, Callable[[int], str]] = {
    "zero_stage_spaces": lambda n: ('{"tenants":[{"id":0,"gpus":1,"zero_stage":"' + " " * n
                                    + 'x"}]}'),
    "tenant_id_spaces": lambda n: '{"tenants":[{"id":"' + " " * n + 'x","gpus":1}]}',
    "think_tags": lambda n: "<think>" * (n // 7),
    "open_braces": lambda n: "{" * n,
    "open_brackets": lambda n: "[" * n,
    "nested_objects": lambda n: '{"a":' * (n // 5),
    "quotes": lambda n: '"' * n,
    "fences": lambda n: "```" * (n // 3),
    "json_fences": lambda n: "```json\n{" * (n // 9),
    "brace_quote": lambda n: '{"' * (n // 2),
    "many_small_objects": lambda n: '{"x": 1} ' * (n // 9),
    "trailing_commas": lambda n: "[" + "1," * (n // 2) + " " * 10,
    "python_literals": lambda n: "{'a': " + "True, " * (n // 6),
    "escapes": lambda n: '{"a": "' + "\\" * n,
    "long_number": lambda n: '{"tenants":[{"id":0,"gpus":' + "9" * n + "}]}",
}
