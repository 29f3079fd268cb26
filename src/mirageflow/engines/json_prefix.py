"""The grammar of what completes a response prefix to JSON valid against a schema.

A JSON output with a ``response_prefix`` (e.g. ``{"answer": ``) puts the prefix at the end
of the prompt, so the model writes only the rest. A grammar compiled from the schema
starts at the beginning of a JSON value and would make the model restart the object.
SGLang (0.5.23) takes a request grammar as ``json_schema``, ``regex`` or ``ebnf`` and has no
way to start one part-way, so the SGLang backends send, as ``ebnf``, the grammar of the
*continuation*: the schema's grammar (xgrammar's own EBNF of it, the grammar SGLang would
compile) differentiated by the prefix, character by character (the Brzozowski derivative
of a context-free grammar: ``D_c(A B) = D_c(A) B | D_c(B) if A is nullable``, and a rule's
derivative is a new rule). The original rules are kept as they are; the result compiles
with ``xgrammar.GrammarCompiler.compile_grammar`` (what SGLang's ``ebnf`` does).

Whitespace as in the transformers engine (``any_whitespace=False``: JSON laid out as
``json.dumps`` does); a prefix that only fits free whitespace (``{\\n  "a": ``) gets the
schema's free-whitespace grammar. ``continuation_grammar`` raises ValueError when no JSON
valid against the schema starts with the prefix.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

ROOT = "root"


# ---------------------------------------------------------------------------- the grammar AST


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Cls:
    source: str  # as printed ("[^\\0-\\x1f]"), reprinted verbatim
    negated: bool
    ranges: tuple[tuple[int, int], ...]

    def matches(self, c: str) -> bool:
        inside = any(lo <= ord(c) <= hi for lo, hi in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Rep:
    item: object
    lo: int
    hi: int  # -1: unbounded


EPS = Lit("")
EMPTY = Alt(())  # the empty language


def seq(*items):
    out = []
    for x in items:
        if x == EMPTY:
            return EMPTY
        if x == EPS:
            continue
        out.extend(x.items if isinstance(x, Seq) else (x,))
    return EPS if not out else out[0] if len(out) == 1 else Seq(tuple(out))


def alt(*items):
    out = []
    for x in items:
        for y in x.items if isinstance(x, Alt) else (x,):
            if y not in out:
                out.append(y)
    return EMPTY if not out else out[0] if len(out) == 1 else Alt(tuple(out))


# ---------------------------------------------------------------------------- parsing xgrammar's EBNF

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "b": "\b", "f": "\f", "v": "\v", "a": "\a", "e": "\x1b"}


class _Parser:
    """xgrammar's printed EBNF: one ``name ::= body [(= lookahead)]`` per line."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"cannot read the schema's grammar ({what} at {self.s[max(0, self.i - 20) : self.i + 20]!r})")

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def peek(self) -> str:
        self.ws()
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, token: str):
        self.ws()
        if not self.s.startswith(token, self.i):
            raise self.error(f"expected {token!r}")
        self.i += len(token)

    def alternatives(self):
        items = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence())
        return alt(*items) if len(items) > 1 else items[0]

    def sequence(self):
        items = []
        while self.peek() not in ("", "|", ")") and not self.s.startswith("(=", self.i):
            items.append(self.postfix())
        return seq(*items) if items else EPS

    def postfix(self):
        node = self.atom()
        while self.i < len(self.s) and self.s[self.i] in "*+?{":
            c = self.s[self.i]
            self.i += 1
            if c == "{":
                end = self.s.index("}", self.i)
                parts = [p.strip() for p in self.s[self.i : end].split(",")]
                self.i = end + 1
                lo = int(parts[0] or 0)
                hi = lo if len(parts) == 1 else int(parts[1]) if parts[1] else -1
            else:
                lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[c]
            node = Rep(node, lo, hi)
        return node

    def char(self, in_class: bool) -> str:
        c = self.s[self.i]
        self.i += 1
        if c != "\\":
            return c
        e = self.s[self.i]
        self.i += 1
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            code = self.s[self.i : self.i + width]
            self.i += width
            return chr(int(code, 16))
        return _ESCAPES.get(e, e)

    def atom(self):
        c = self.peek()
        if c == "(":
            self.i += 1
            node = self.alternatives()
            self.expect(")")
            return node
        if c == '"':
            self.i += 1
            chars = []
            while self.s[self.i] != '"':
                chars.append(self.char(False))
            self.i += 1
            return Lit("".join(chars))
        if c == "[":
            start = self.i
            self.i += 1
            negated = self.s[self.i] == "^"
            self.i += negated
            ranges = []
            while self.s[self.i] != "]":
                lo = self.char(True)
                hi = lo
                if self.s[self.i] == "-" and self.s[self.i + 1] != "]":
                    self.i += 1
                    hi = self.char(True)
                ranges.append((ord(lo), ord(hi)))
            self.i += 1
            return Cls(self.s[start : self.i], negated, tuple(ranges))
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isalnum() or self.s[self.i] == "_"):
            self.i += 1
        if start == self.i:
            raise self.error("unexpected character")
        return Ref(self.s[start : self.i])


def parse_ebnf(text: str) -> tuple[dict, dict]:
    """(rule name -> body, rule name -> lookahead) of xgrammar's printed grammar."""
    rules, lookaheads = {}, {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep:
            raise ValueError(f"cannot read the schema's grammar (no '::=' in {line!r})")
        p = _Parser(body)
        rules[name.strip()] = p.alternatives()
        if p.s.startswith("(=", p.i):
            p.i += 2
            lookaheads[name.strip()] = p.alternatives()
            p.expect(")")
        if p.peek():
            raise p.error("trailing text")
    return rules, lookaheads


# ---------------------------------------------------------------------------- printing


def _quote(text: str) -> str:
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable() and c != "\x7f":
            out.append(c)
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def show(node) -> str:
    if isinstance(node, Lit):
        return _quote(node.text)
    if isinstance(node, Cls):
        return node.source
    if isinstance(node, Ref):
        return node.name
    if isinstance(node, Seq):
        return "(" + " ".join(show(x) for x in node.items) + ")"
    if isinstance(node, Alt):
        if not node.items:
            raise ValueError("the empty language has no EBNF")
        return "(" + " | ".join(show(x) for x in node.items) + ")"
    if isinstance(node, Rep):
        suffix = {(0, -1): "*", (1, -1): "+", (0, 1): "?"}.get((node.lo, node.hi), f"{{{node.lo}, {node.hi}}}")
        return f"({show(node.item)}){suffix}"
    raise TypeError(node)


# ---------------------------------------------------------------------------- derivatives


class _Grammar:
    def __init__(self, rules: dict, lookaheads: dict):
        self.rules, self.lookaheads = dict(rules), dict(lookaheads)
        self.derived: dict[tuple[str, str], str] = {}  # (rule, char) -> the derivative's rule
        self.nullable: set[str] = set()
        self.building: set[str] = set()
        self.base: dict[str, str] = {}  # a derivative's rule -> the original rule (short names)

    def _nullable(self, node) -> bool:
        if isinstance(node, Lit):
            return node.text == ""
        if isinstance(node, Cls):
            return False
        if isinstance(node, Ref):
            return node.name in self.nullable
        if isinstance(node, Seq):
            return all(self._nullable(x) for x in node.items)
        if isinstance(node, Alt):
            return any(self._nullable(x) for x in node.items)
        return node.lo == 0 or self._nullable(node.item)

    def update_nullable(self):
        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                if name not in self.nullable and self._nullable(body):
                    self.nullable.add(name)
                    changed = True

    def derive(self, node, c: str):
        if isinstance(node, Lit):
            return Lit(node.text[1:]) if node.text[:1] == c else EMPTY
        if isinstance(node, Cls):
            return EPS if node.matches(c) else EMPTY
        if isinstance(node, Seq):
            head, rest = node.items[0], seq(*node.items[1:])
            first = seq(self.derive(head, c), rest)
            return alt(first, self.derive(rest, c)) if self._nullable(head) else first
        if isinstance(node, Alt):
            return alt(*(self.derive(x, c) for x in node.items))
        if isinstance(node, Rep):
            if node.hi == 0:
                return EMPTY
            # a nullable item may match empty first: its later copies still fit the bounds
            return seq(self.derive(node.item, c), Rep(node.item, max(node.lo - 1, 0), -1 if node.hi < 0 else node.hi - 1))
        key = (node.name, c)
        if key not in self.derived:
            base = self.base.get(node.name, node.name)
            name = f"{base}_c{len(self.derived)}"
            while name in self.rules:
                name += "_"
            self.base[name] = base
            self.derived[key] = name
            self.building.add(name)  # a left-recursive reference meets the rule being built
            self.rules[name] = EMPTY
            self.rules[name] = self.derive(self.rules[node.name], c)
            self.building.discard(name)
        name = self.derived[key]
        return Ref(name) if name in self.building or self.rules[name] != EMPTY else EMPTY

    def productive(self) -> set[str]:
        good: set[str] = set()

        def ok(node) -> bool:
            if isinstance(node, Lit | Cls):
                return True
            if isinstance(node, Ref):
                return node.name in good
            if isinstance(node, Seq):
                return all(map(ok, node.items))
            if isinstance(node, Alt):
                return any(map(ok, node.items))
            return node.lo == 0 or ok(node.item)

        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                if name not in good and ok(body):
                    good.add(name)
                    changed = True
        return good


def _prune(node, good: set[str]):
    """The node without references to rules whose language is empty."""
    if isinstance(node, Ref):
        return node if node.name in good else EMPTY
    if isinstance(node, Seq):
        return seq(*(_prune(x, good) for x in node.items))
    if isinstance(node, Alt):
        return alt(*(_prune(x, good) for x in node.items))
    if isinstance(node, Rep):
        item = _prune(node.item, good)
        return (EPS if node.lo == 0 else EMPTY) if item == EMPTY else Rep(item, node.lo, node.hi)
    return node


def _refs(node):
    if isinstance(node, Ref):
        yield node.name
    elif isinstance(node, Seq | Alt):
        for x in node.items:
            yield from _refs(x)
    elif isinstance(node, Rep):
        yield from _refs(node.item)


def derivative_ebnf(ebnf: str, prefix: str) -> str | None:
    """The EBNF (root rule ``root``) of {s : prefix + s in the language of ``ebnf``}, or None
    when no string of the language starts with ``prefix``."""
    rules, lookaheads = parse_ebnf(ebnf)
    start = ROOT
    taken = set(rules)
    if ROOT in rules:  # the new root is the derivative; the old one keeps a free name
        start = next(n for n in (f"json_root{i or ''}" for i in range(len(rules) + 1)) if n not in taken)
        rename = {ROOT: start}
        rules = {rename.get(k, k): _rename(v, rename) for k, v in rules.items()}
        lookaheads = {rename.get(k, k): _rename(v, rename) for k, v in lookaheads.items()}
    g = _Grammar(rules, lookaheads)
    node = Ref(start)
    for c in prefix:
        g.update_nullable()
        node = g.derive(node, c)
        if node == EMPTY:
            return None
    good = g.productive()
    node = _prune(node, good)
    if node == EMPTY:
        return None
    lines, seen, todo = [f"{ROOT} ::= {show(node)}"], set(), list(_refs(node))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        body = _prune(g.rules[name], good)
        look = lookaheads.get(name)
        lines.append(f"{name} ::= {show(body)}" + (f" (={show(look)})" if look is not None else ""))
        todo.extend(_refs(body))
        if look is not None:
            todo.extend(_refs(look))
    return "\n".join(lines) + "\n"


def _rename(node, names: dict):
    if isinstance(node, Ref):
        return Ref(names.get(node.name, node.name))
    if isinstance(node, Seq):
        return Seq(tuple(_rename(x, names) for x in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_rename(x, names) for x in node.items))
    if isinstance(node, Rep):
        return Rep(_rename(node.item, names), node.lo, node.hi)
    return node


def _value_prefix(prop: dict, text: str) -> str | None:
    """How ``text`` reads as the start of a value of ``prop`` laid out as json.dumps lays it
    out: "complete" (the whole value), "partial" (a value not yet ended), or None when not
    certain (then xgrammar decides). Bounded numbers are left to xgrammar."""
    kind = prop.get("type")
    if kind == "string":
        if not text.startswith('"'):
            return None
        body = text[1:]
        end = body.find('"')
        chars = body if end < 0 else body[:end]
        if "\\" in chars or any(ord(c) < 0x20 for c in chars):
            return None
        return "partial" if end < 0 else "complete" if end == len(body) - 1 else None
    if kind == "boolean":
        for word in ("true", "false"):
            if text == word:
                return "complete"
            if word.startswith(text) and text:
                return "partial"
        return None
    if kind in ("integer", "number") and "minimum" not in prop and "maximum" not in prop:
        digits = text[1:] if text.startswith("-") else text
        if digits and not digits.isdigit() or digits.startswith("0") and len(digits) > 1:
            return None
        return "partial" if not digits else "complete"
    return None


def certainly_starts(schema: dict, prefix: str) -> bool:
    """Whether ``prefix`` certainly starts an answer valid against ``schema``, an output's
    flat schema (an object whose typed properties are all required, in order), laid out
    as json.dumps lays it out, as xgrammar's grammar without free whitespace takes it. A
    pure-Python answer for the usual prefixes (``{"answer": ``, ``{"subject": "``): False
    means only "not certain here", and ``continuation_grammar`` (which imports xgrammar,
    and with it torch) decides."""
    if schema.get("type") != "object" or not prefix.startswith("{"):
        return False
    props = schema.get("properties") or {}
    if list(schema.get("required") or []) != list(props):
        return False
    rest = prefix[1:]
    for i, (name, prop) in enumerate(props.items()):
        if not rest:
            return True
        key = ("" if i == 0 else ", ") + json.dumps(name) + ": "
        if key.startswith(rest):
            return True  # within the key
        if not rest.startswith(key):
            return False
        rest = rest[len(key) :]
        for cut in range(len(rest), -1, -1):  # the longest start of rest that is a whole value
            if _value_prefix(prop, rest[:cut]) == "complete" and (cut == len(rest) or rest[cut] in ",}"):
                break
        else:
            return _value_prefix(prop, rest) == "partial"
        if cut == len(rest):
            return True  # a whole value: a separator or the end may follow
        rest = rest[cut:]
    return rest == "" or rest == "}"


@functools.lru_cache(maxsize=64)
def continuation_grammar(schema_json: str, prefix: str) -> str:
    """EBNF of the text that completes ``prefix`` to JSON valid against the schema (a JSON
    string, as Request.json_schema); ValueError when no valid JSON starts with the prefix."""
    import xgrammar

    for any_whitespace in (False, True):
        ebnf = str(xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=any_whitespace))
        grammar = derivative_ebnf(ebnf, prefix)
        if grammar is not None:
            return grammar
    raise ValueError(f"the response prefix {prefix!r} does not start any JSON value valid against the output's schema")
