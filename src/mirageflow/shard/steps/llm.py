"""One output variable of the pipeline, fixed for the whole shard: how a row's variables
become a request, and how the engine's completion becomes the variable's value.

Reasoning is never the answer: a leading ``<think>...</think>`` block (Qwen3, DeepSeek-R1)
is cut from the text, and a server's ``reasoning_content`` (``Completion.reasoning``) is
kept apart by the engine. With ``keep_reasoning: true`` on the output, the reasoning is the
row variable ``<name>_reasoning`` (None when the model gave none). An answer cut by the
length limit while still reasoning (an unclosed ``<think>``, or reasoning and no answer) is
the row error ``reasoning_truncated``.

This is the one kind of step (shard/steps/base.py) that ``calls_engine``: the row path
(``shard/rows.py``: ``RowPath._steps``, the hot path) builds its ``request``, gets the answer
from the engine or the request cache and hands it to ``assign``.
"""

from __future__ import annotations

import json

from mirageflow.prompts import images as image_inputs
from mirageflow.prompts import json_output
from mirageflow.data.readers import lone_surrogate_at
from mirageflow.config.types import OutputVar, ProcessorConfig
from mirageflow.engines.base import Engine
from mirageflow.engines.wire import Completion, Request
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.prompts.templates import PromptBuilder
from mirageflow.shard.request_cache import RequestKeys
from mirageflow.shard.steps.base import Step

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, answer, closed) of a model's text: a leading ``<think>...</think>`` block
    (after whitespace) is the reasoning and the rest, without leading whitespace, the
    answer. Without the closing tag the whole text is reasoning (closed False)."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text, True
    body = stripped[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip(), "", False
    return body[:end].strip(), body[end + len(THINK_CLOSE) :].lstrip(), True


class LLMStep(Step):
    """``outputs[]`` of type llm: a request per row (sample), its answer the output's value."""

    calls_engine = True

    def __init__(self, output: OutputVar, processor: ProcessorConfig, engine: Engine):
        self.output, self.processor, self.engine = output, processor, engine
        self.builder = PromptBuilder(output)
        self.sampling = {**processor.sampling_params, **output.sampling_params}
        # the base of per-request seeds, never sent as is (mirageflow/shard/samples.py)
        self.base_seed: int | None = self.sampling.pop("seed", None)
        self.schema_json = json.dumps(output.schema.json_schema()) if output.is_json else None
        self.validator = output.schema.validator() if output.is_json else None
        # OpenAI-compatible servers apply the chat template themselves.
        self.server_templates = engine.templates_server_side
        self.keep_reasoning = output.keep_reasoning
        self.reasoning_name = f"{output.name}_reasoning"
        # the request cache's keys of this step's requests (shard/request_cache.py); None: not cached
        self.cache_keys: RequestKeys | None = None

    def use_cache(self, identity: str) -> None:
        """Key this step's requests for the request cache, under the engine identity ``identity``."""
        self.cache_keys = RequestKeys(identity, self.sampling, self.schema_json, self.output.response_prefix)

    def request(self, rid: int, variables: dict, seed: int | None = None, images: dict | None = None) -> Request:
        """``images``: the row's loaded image inputs (name -> list), put into the user turn."""
        if images:
            messages = self.builder.messages(image_inputs.marked(variables, images))
            placed = image_inputs.attach(messages, images, images)
        else:
            messages, placed = self.builder.messages(variables), None
        prefix = self.output.response_prefix
        if not self.processor.apply_chat_template:
            prompt = messages[-1]["content"] + prefix
        elif self.server_templates:  # the engine sends the messages; the server continues the prefix
            prompt = None
        else:
            try:
                prompt = self.engine.chat_prompt(messages, self.processor.chat_template_kwargs) + prefix
            except Exception as e:  # a template that rejects this row's messages
                raise RowError("render", E.CHAT_TEMPLATE, f"chat template failed: {type(e).__name__}: {e}") from None
        # engines constrain JSON after the prefix (Request.response_prefix)
        return Request(rid, messages, prompt, self.sampling, self.schema_json, seed=seed, response_prefix=prefix, images=placed)

    def assign(self, variables: dict, c: Completion) -> None:
        """Set the row's variable from the completion (and ``<name>_reasoning`` with keep_reasoning)."""
        value, reasoning = self.value(c)
        variables[self.output.name] = value
        if self.keep_reasoning:
            variables[self.reasoning_name] = reasoning

    def value(self, c: Completion):
        """(the output's value, the model's reasoning or None); RowError when there is no usable answer."""
        name = self.output.name
        if c.error_kind:
            raise RowError("generate", c.error_kind, c.error or c.error_kind)
        if c.finish_reason == "abort":
            raise RowError("generate", E.ABORTED, "the engine aborted the request", raw=c.text)
        thought, answer, closed = split_reasoning(c.text or "")
        reasoning = "\n\n".join(r for r in (c.reasoning, thought) if r) or None
        if c.finish_reason == "length" and reasoning is not None and (not closed or not answer.strip()):
            raise RowError("output", E.REASONING_TRUNCATED,
                f"output '{name}': the length limit (max_new_tokens) cut the answer while the model "
                "was still reasoning; raise max_new_tokens or turn thinking off (chat_template_kwargs)",
                raw=c.text,
            )  # fmt: skip
        if (not answer or answer.isspace()) and not self.output.allow_empty_output:
            # a reasoning-only answer, or one cut by the length limit before any text
            raise RowError("output", E.EMPTY_OUTPUT,
                f"output '{name}': the engine returned no text (finish_reason {c.finish_reason!r})"
                + (" besides its reasoning" if reasoning is not None else "")
                + "; set allow_empty_output: true on this output to keep empty answers",
                raw=c.text,
            )  # fmt: skip
        text = self.output.response_prefix + answer
        if lone_surrogate_at(text):
            raise RowError("output", E.INVALID_UNICODE, f"output '{name}': the answer holds a lone surrogate (invalid Unicode)")
        if not self.output.is_json:
            return text, reasoning
        try:
            value = json_output.parse_answer(text, self.validator, truncated=c.finish_reason == "length")
        except json_output.OutputError as e:
            raise RowError("output", e.kind, f"output '{name}': {e}", raw=text) from None
        if "\\u" in text and lone_surrogate_at(value):  # JSON escapes can spell a lone surrogate
            raise RowError(
                "output", E.INVALID_UNICODE, f"output '{name}': the JSON answer holds a lone surrogate (\\ud800-\\udfff)", raw=text
            )
        return value, reasoning
