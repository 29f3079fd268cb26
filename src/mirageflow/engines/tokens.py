"""Prompt token ids with exactly one BOS: what the SGLang backends send and transformers feeds.

A rendered chat template usually starts with the BOS already; a tokenizer called with
``add_special_tokens=True`` (what SGLang does with a text prompt) adds a second one.
"""

from __future__ import annotations


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` (add_special_tokens=True, what SGLang does with a text
    prompt) puts the BOS token in front."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer without the call: assume not
        return False
    return bool(ids) and ids[0] == bos


def prompt_token_ids(tokenizer, text: str, bos: int | None) -> list[int]:
    """The model input's token ids, with exactly one BOS when ``bos`` is the id the
    tokenizer adds (``adds_bos``), and none added otherwise.

    A rendered chat template usually starts with the BOS already (Llama 3, Gemma, Mistral,
    DeepSeek); SGLang tokenizes text prompts with ``add_special_tokens=True``, which adds
    a second one. Engines therefore tokenize here with ``add_special_tokens=False``, put
    one BOS in front when the text has none (a raw prompt, ``apply_chat_template:
    false``), drop repeats of it, and send the ids.
    """
    return _one_bos(list(tokenizer(text, add_special_tokens=False)["input_ids"]), bos)


def _one_bos(ids: list[int], bos: int | None) -> list[int]:
    if bos is None:
        return ids
    start = 0
    while start < len(ids) and ids[start] == bos:
        start += 1
    return [bos, *ids[start:]]


class PromptTokenizer:
    """``prompt_token_ids`` with the tokenizer's BOS behaviour read once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None

    def __call__(self, text: str) -> list[int]:
        return prompt_token_ids(self.tokenizer, text, self.bos)

    def batch(self, texts: list[str]) -> list[list[int]]:
        """Several prompts in one tokenizer call."""
        return [_one_bos(list(ids), self.bos) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
