"""How the SGLang fakes answer a constrained request: as SGLang with a model that wants
to write ``answer`` (a complete JSON text).

- ``json_schema``: SGLang's grammar starts at the first generated token, so the answer is
  the whole JSON, even after a response prefix at the end of the prompt (the restart a
  prefix then causes, as with the real package).
- ``ebnf``: compiled by the real xgrammar (SGLang's xgrammar backend calls
  ``GrammarCompiler.compile_grammar``); the answer is the longest tail of ``answer`` the
  grammar accepts to the end (after a prefix ``{"answer": `` that is ``"yes"}``). An EBNF
  that does not compile is a ValueError, as SGLang's invalid-grammar abort (status 400);
  no fitting tail is a GrammarFailure (SGLang's 500 "Grammar accept_token failed").
"""

from __future__ import annotations

import functools


class GrammarFailure(RuntimeError):
    pass


@functools.lru_cache(maxsize=32)
def _compiled(ebnf: str):
    import xgrammar

    try:
        return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(ebnf)
    except RuntimeError as e:
        raise ValueError(f"Invalid ebnf grammar: {e}") from None


def constrained_answer(params: dict, answer: str) -> str:
    ebnf = params.get("ebnf")
    if ebnf is None:
        return answer
    import xgrammar

    grammar = _compiled(ebnf)
    for start in range(len(answer) + 1):
        matcher = xgrammar.GrammarMatcher(grammar)
        if matcher.accept_string(answer[start:]) and matcher.is_completed():
            return answer[start:]
    raise GrammarFailure(f"Grammar accept_token failed: no tail of {answer!r} fits the ebnf grammar")
