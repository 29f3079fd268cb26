"""One output variable of the pipeline, fixed for the whole shard: how a row's variables
become a request, and how the engine's completion becomes the variable's value."""

from __future__ import annotations

import json

from mirageflow import json_output
from mirageflow.data.readers import lone_surrogate_at
from mirageflow.engines.base import Completion, Engine, Request
from mirageflow.prompts import PromptBuilder, RowError


class OutputStep:
    def __init__(self, output, processor, engine: Engine):
        self.output, self.processor, self.engine = output, processor, engine
        self.builder = PromptBuilder(output)
        self.sampling = {**processor.sampling_params, **output.sampling_params}
        self.schema_json = json.dumps(output.schema.json_schema()) if output.is_json else None
        self.validator = output.schema.validator() if output.is_json else None
        # OpenAI-compatible servers apply the chat template themselves.
        self.server_templates = getattr(engine, "templates_server_side", False)

    def request(self, rid: int, variables: dict) -> Request:
        messages = self.builder.messages(variables)
        prefix = self.output.response_prefix
        if not self.processor.apply_chat_template:
            prompt = messages[-1]["content"] + prefix
        elif self.server_templates:  # the engine sends the messages; the server continues the prefix
            prompt = None
            if prefix:
                messages.append({"role": "assistant", "content": prefix})
        else:
            try:
                prompt = self.engine.chat_prompt(messages, self.processor.chat_template_kwargs) + prefix
            except Exception as e:  # a template that rejects this row's messages
                raise RowError("render", "chat_template", f"chat template failed: {type(e).__name__}: {e}") from None
        return Request(rid, messages, prompt, self.sampling, self.schema_json)

    def value(self, c: Completion):
        name = self.output.name
        if c.error_kind:
            raise RowError("generate", c.error_kind, c.error or c.error_kind)
        if c.finish_reason == "abort":
            raise RowError("generate", "aborted", "the engine aborted the request", raw=c.text)
        if (not c.text or c.text.isspace()) and not self.output.allow_empty_output:
            # a reasoning-only answer, or one cut by the length limit before any text
            raise RowError(
                "output", "empty_output",
                f"output '{name}': the engine returned no text (finish_reason {c.finish_reason!r}); "
                "set allow_empty_output: true on this output to keep empty answers",
                raw=c.text,
            )  # fmt: skip
        text = self.output.response_prefix + c.text
        if lone_surrogate_at(text):
            raise RowError("output", "invalid_unicode", f"output '{name}': the answer holds a lone surrogate (invalid Unicode)")
        if not self.output.is_json:
            return text
        try:
            value = json_output.parse_answer(text, self.validator, truncated=c.finish_reason == "length")
        except json_output.OutputError as e:
            raise RowError("output", e.kind, f"output '{name}': {e}", raw=text) from None
        if "\\u" in text and lone_surrogate_at(value):  # JSON escapes can spell a lone surrogate
            raise RowError("output", "invalid_unicode", f"output '{name}': the JSON answer holds a lone surrogate (\\ud800-\\udfff)", raw=text)
        return value
