"""A tokenizer and a tiny Llama built locally, for smoke runs of the TRL bridge (no downloads).

Needs ``torch`` and ``transformers`` (``pip install 'libratio_jax[hf]'``); ``tokenizers`` comes
with transformers.

- :func:`build_tokenizer`: a byte-level BPE tokenizer trained on this library's prompts and
  plans (so they tokenize compactly), with a chat template and pad/eos tokens. Any string can
  be encoded (byte-level). ``plan_tokens`` adds whole plan texts as single tokens: a randomly
  initialised model then emits a valid plan now and then, which gives GRPO rewards that vary
  within a group (a smoke test of learning, not a trick the rewards depend on).
- :func:`build_tool_tokenizer`: the same with TRL's Qwen3 chat template (tool calls and tool
  responses) and its response parser, for multi-turn training with ``environment_factory``.
- :func:`build_tiny_llama`: a ``LlamaForCausalLM`` of a few hundred thousand parameters.

Example (skipped where torch is not installed):
    >>> from libratio_jax.integrations.trl import build_dataset
    >>> rows = build_dataset(2, difficulty="easy")
    >>> tok = build_tokenizer(corpus_of(rows))  # doctest: +SKIP
    >>> model = build_tiny_llama(tok)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# A minimal chat template: <|role|>content<|eos|> per message, then <|assistant|> to generate.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")


def corpus_of(rows: Sequence[dict]) -> list[str]:
    """Texts to train a tokenizer on: the prompts' messages (and context plans) of dataset
    rows from :func:`~libratio_jax.integrations.trl.build_dataset`."""
    out = []
    for r in rows:
        p = r["prompt"]
        out.extend([m["content"] for m in p] if isinstance(p, list) else [p])
        if r.get("context_plan"):
            out.append(r["context_plan"])
    return out


def _bpe(texts: Iterable[str], vocab_size: int, special: Sequence[str],
         whole: Sequence[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, with ``whole`` strings
    added as single tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    if whole:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in whole])
    return tok


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = 512,
                    plan_tokens: Sequence[str] = ()):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) trained on ``texts``."""
    from transformers import PreTrainedTokenizerFast

    tok = _bpe(texts, vocab_size, SPECIAL_TOKENS, plan_tokens)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>",
                                   chat_template=CHAT_TEMPLATE)


# The markers of TRL's Qwen3 chat template (tool calls in <tool_call> JSON </tool_call>).
TOOL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
                       "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                       "</think>")


def tool_call_text(name: str, **arguments) -> str:
    """One tool call as the Qwen3 template writes it."""
    import json

    return ("<tool_call>\n" + json.dumps({"name": name, "arguments": arguments})
            + "\n</tool_call>")


def build_tool_tokenizer(texts: Iterable[str], *, vocab_size: int = 512,
                         call_tokens: Sequence[str] = ()):
    """A byte-level BPE tokenizer for multi-turn tool use: TRL's Qwen3 chat template (tools,
    tool calls, tool responses) with its response template set (``add_response_schema``), so
    ``GRPOTrainer`` parses tool calls from generations. ``call_tokens``: whole tool calls
    (:func:`tool_call_text`) added as single tokens, so a random model calls tools now and
    then. Needs ``trl``."""
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    tok = _bpe(texts, vocab_size, TOOL_SPECIAL_TOKENS, call_tokens)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=qwen3_chat_template)
    return add_response_schema(fast)


def build_tiny_llama(tokenizer, *, hidden: int = 32, layers: int = 2, heads: int = 2,
                     kv_heads: int = 1, max_positions: int = 4096, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` sized for CPU smoke runs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)
