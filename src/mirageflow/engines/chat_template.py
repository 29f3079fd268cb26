"""The model's chat template rendered as ``tokenizer.apply_chat_template`` does, compiled once.

``ChatTemplate`` is the default ``Engine.chat_prompt`` (engines/base.py) and what the engine
service ships to its shards (``spec``/``from_spec``, engines/shared.py).
"""

from __future__ import annotations

import json


def _chat_template_env():
    """A Jinja2 environment that renders chat templates as transformers does.

    Same settings as ``transformers.utils.chat_template_utils._compile_jinja_template``:
    sandboxed, trim_blocks/lstrip_blocks, loop controls, a ``tojson`` that does not escape
    HTML, ``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks (which
    render their body; the tracker transformers attaches to them is off for text output).
    """
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_CHAT_ENV = None


class ChatTemplate:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)``
    with the template compiled once.

    transformers spends most of each call on bookkeeping around the render (~80 us per
    row); this renders the same compiled template with the same variables (the
    tokenizer's special tokens, ``tools``/``documents`` None, the kwargs) and yields the
    same text (tests/test_fast_paths.py checks several templates). It falls back to the
    tokenizer's own method when exactness is not certain: a tokenizer class with its own
    ``apply_chat_template``, a template that does not compile, or kwargs that are
    parameters of ``apply_chat_template`` itself (``tools``, ``continue_final_message``...).
    The special tokens are read once, at construction.
    """

    def __init__(self, tokenizer):
        global _CHAT_ENV
        self.tokenizer = tokenizer
        self._template = None
        try:
            import inspect

            from transformers import PreTrainedTokenizerBase

            cls = type(tokenizer)
            if cls.apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template or not isinstance(
                tokenizer, PreTrainedTokenizerBase
            ):
                return
            source = tokenizer.get_chat_template()
            if not isinstance(source, str):
                return
            if _CHAT_ENV is None:
                _CHAT_ENV = _chat_template_env()
            from mirageflow.prompts.templates import fast_renderer

            self._template = _CHAT_ENV.from_string(source)
            self._source = source
            self._render = fast_renderer(self._template)
            self._reserved = frozenset(inspect.signature(cls.apply_chat_template).parameters) | {"messages"}
            self._base = {**tokenizer.special_tokens_map, "tools": None, "documents": None, "add_generation_prompt": True}
        except Exception:  # no transformers, no template, a template that does not compile: the slow path
            self._template = None

    def spec(self) -> dict | None:
        """What renders the same text in another process (engines/shared.py); None without the fast path."""
        if self._template is None:
            return None
        return {"source": self._source, "base": self._base, "reserved": sorted(self._reserved)}

    @classmethod
    def from_spec(cls, spec: dict, tokenizer) -> "ChatTemplate":
        """The template of ``spec()``; ``tokenizer`` only needs ``apply_chat_template`` (the slow path)."""
        global _CHAT_ENV
        from mirageflow.prompts.templates import fast_renderer

        if _CHAT_ENV is None:
            _CHAT_ENV = _chat_template_env()
        self = cls.__new__(cls)
        self.tokenizer, self._source = tokenizer, spec["source"]
        self._template = _CHAT_ENV.from_string(spec["source"])
        self._render = fast_renderer(self._template)
        self._reserved, self._base = frozenset(spec["reserved"]), dict(spec["base"])
        return self

    def __call__(self, messages: list[dict[str, str]], kwargs: dict | None = None) -> str:
        if self._template is None or not messages or (kwargs and not self._reserved.isdisjoint(kwargs)):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
        if kwargs:
            return self._render({**self._base, **kwargs, "messages": messages})
        return self._render({**self._base, "messages": messages})
