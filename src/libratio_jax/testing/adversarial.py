"""Adversarial completion texts: shapes that make naive parsers super-linear (backtracking
regular expressions, rescans from every bracket) or slow per character (a Python step per
bracket, per override, per repair). Used by the hardening tests (time grows linearly) and by
``benchmarks/reward_latency.py`` (the worst 32 KB completion's latency).

Each shape makes a text of at most ``n`` characters: a head, a unit repeated, a tail.

    >>> len(SHAPES["open_braces"](1024))
    1024
    >>> all(len(make(1000)) <= 1000 for make in SHAPES.values())
    True
"""

from __future__ import annotations

from collections.abc import Callable


def _shape(unit: str, head: str = "", tail: str = "") -> Callable[[int], str]:
    """``head + unit * k + tail`` with the largest ``k`` that keeps it within ``n``."""
    def make(n: int) -> str:
        return head + unit * max((n - len(head) - len(tail)) // len(unit), 0) + tail
    return make


def _keyed(template: str, head: str, tail: str) -> Callable[[int], str]:
    """``head`` + ``template % i`` for i = 0, 1, ... (distinct keys) + ``tail``, within ``n``."""
    def make(n: int) -> str:
        parts, size, i = [], len(head) + len(tail), 0
        while size + len(template % i) <= n:
            parts.append(template % i)
            size += len(parts[-1])
            i += 1
        return head + "".join(parts) + tail
    return make


# name -> a text of at most n characters
SHAPES: dict[str, Callable[[int], str]] = {
    "zero_stage_spaces": _shape(" ", '{"tenants":[{"id":0,"gpus":1,"zero_stage":"', 'x"}]}'),
    "tenant_id_spaces": _shape(" ", '{"tenants":[{"id":"', 'x","gpus":1}]}'),
    "think_tags": _shape("<think>"),
    "think_ends": _shape("</think>"),
    "open_braces": _shape("{"),
    "open_brackets": _shape("["),
    "nested_objects": _shape('{"a":'),
    "quotes": _shape('"'),
    "fences": _shape("```"),
    "json_fences": _shape("```json\n{"),
    "brace_quote": _shape('{"'),
    "unclosed_strings": _shape('{"a'),
    "escaped_quotes": _shape('{"\\"'),
    "many_small_objects": _shape('{"x": 1} '),
    "fenced_pairs": _shape("```\n" + '{"a":[1]} ' * 180 + "\n```\n"),
    "tiny_fences": _shape('```\n",}```'),
    "nested_pairs": _shape('{"a":[1]} '),
    "object_then_opener": _shape('{"x": 1} {'),
    "empty_pairs": _shape("[]"),
    "nested_empty": _shape("[[]]"),
    "mismatched": _shape("{]"),
    "quoted_brackets": _shape('["{"]'),
    "deep_balanced": lambda n: "[" * (n // 2) + "]" * (n // 2),
    "trailing_commas": _shape("1,", "[", " " * 10),
    "python_literals": _shape("True, ", "{'a': "),
    "escapes": _shape("\\", '{"a": "'),
    "long_number": _shape("9", '{"tenants":[{"id":0,"gpus":', "}]}"),
    "long_key": _shape("k", '{"tenants":[{"id":0,"', '":1}]}'),
    "many_entries": _shape('{"gpus": 1},', '{"tenants": [', "]}"),
    "many_layer_overrides": _keyed('"%d":"bf16",', '{"tenants":[{"id":0,"precision":{"layers":{',
                                   '"0":"bf16"}}}]}'),
    "many_block_overrides": _keyed('"%d":{"mlp":"fp8"},',
                                   '{"tenants":[{"id":0,"precision":{"blocks":{', '}}}]}'),
}
