"""Bounds on one template render: time, output size and what it may build on the way.

A prompt, system prompt, record template or filter predicate is rendered once per row on
the event loop that feeds the engine, so one hostile or mistaken template (nested loops
over ``range(100000)``, ``{{ text * 200000000 }}``) must cost its row, never the shard:

- **time**: a render runs at most ``RENDER_TIMEOUT_SECONDS``; a watchdog thread then
  raises ``RenderTimeout`` inside the rendering thread (``PyThreadState_SetAsyncExc``:
  Jinja2 templates compile to Python code, which checks for it between instructions);
- **size**: the rendered text is at most ``MAX_RENDER_CHARS`` characters (counted as it is
  produced, and before any ``concat`` of a block's buffer); everything a render builds
  (operators ``*``, ``+``, ``%``, ``**``, every filter, every method call) is counted
  against a budget of ``ALLOC_BUDGET_CHARS`` per render, and the calls that can make a
  huge value from a small one (``'x' * n``, ``center(n)``, ``10 ** n``, a format width)
  are refused before they run;
- a ``MemoryError`` on the way is the same row error.

Either way the row fails with its own class: ``template_timeout`` or ``template_too_large``
(stage ``render``), and the shard goes on. Preflight (``cost_problems``) refuses templates
whose cost it can see in their source: nested loops over big constant ranges, a constant
repetition or width beyond the limits. Templates made only of text and ``{{ name }}``
(the common case: ``templates.Template``'s fast path) never reach Jinja2 and pay nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
import time
from typing import Any, Callable

from jinja2 import nodes
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from mirageflow.errors import RowErrorClass as E

RENDER_TIMEOUT_SECONDS = 5.0
MAX_RENDER_CHARS = 32 << 20  # 33.5 M characters: far above any model's context
ALLOC_BUDGET_CHARS = 4 * MAX_RENDER_CHARS  # all a render may build (strings, lists) on the way
MAX_INT_BITS = 1 << 16  # integers up to ~19,700 digits (Python prints at most 4,300)
# Iterations of nested constant loops preflight accepts (a render runs ~10-50 M simple
# iterations in RENDER_TIMEOUT_SECONDS on one core)
MAX_STATIC_LOOP_ITERATIONS = 10_000_000
WATCHDOG_INTERVAL_SECONDS = 0.1

TIMEOUT_KIND = E.TEMPLATE_TIMEOUT
TOO_LARGE_KIND = E.TEMPLATE_TOO_LARGE


class RenderTimeout(BaseException):
    """Raised inside a render that ran past its deadline (a BaseException: no template or
    library ``except Exception`` swallows it)."""


class RenderTooLarge(BaseException):
    """A render would make (or has made) more than its size limits allow."""


# --------------------------------------------------------------------------- the per-render budget

# thread id -> the render running in it: (deadline, claim, fired, [budget left]); see _Watchdog
_ARMED: dict[int, tuple] = {}
_monotonic, _get_ident = time.monotonic, threading.get_ident
CHARGED_MIN = 256  # values smaller than this are not counted (a render cannot keep many: its time is bounded)
_SIZED = frozenset({str, bytes, list, tuple, dict})


def _charge(size: int) -> None:
    entry = _ARMED.get(_get_ident())
    if entry is None or not entry[1]:  # no render running in this thread
        return
    left = entry[3]
    left[0] -= size
    if left[0] < 0:
        raise RenderTooLarge(f"the render built more than {ALLOC_BUDGET_CHARS} characters of values on the way")


def _charge_value(value: Any) -> None:
    """Count a value a render made against its budget (cheap for the small ones)."""
    cls = value.__class__
    if cls in _SIZED:
        n = len(value)
        if n >= CHARGED_MIN:
            _charge(n)
    elif cls is int and value.bit_length() > 4096:
        _charge(value.bit_length() // 8)


def _size(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return value.bit_length() // 8
    return 0


def _too_big(what: str, size: int) -> RenderTooLarge:
    return RenderTooLarge(f"{what} would make {size} characters, more than the {MAX_RENDER_CHARS} a render may")


_WIDTH = re.compile(r"\d{8,}")  # a width or precision of 8+ digits: 10 M characters or more


def _check_format(fmt: str, args) -> None:
    for m in _WIDTH.finditer(fmt):
        if int(m.group(0)) > MAX_RENDER_CHARS:
            raise _too_big("a format width", int(m.group(0)))
    _check_int_args(args)


def _check_int_args(args) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
            raise _too_big("an argument", abs(a))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and not isinstance(n, bool) and isinstance(seq, (str, bytes, list, tuple)):
                if len(seq) * max(n, 0) > MAX_RENDER_CHARS:
                    raise _too_big(f"repeating a value of {len(seq)} items {n} times", len(seq) * n)
                return
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise RenderTooLarge(f"the product would have more than {MAX_INT_BITS} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                raise RenderTooLarge(f"{left} ** {right} would have more than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) and len(left) + len(right) > MAX_RENDER_CHARS:
            raise _too_big("joining two values", len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check_format(left, right if isinstance(right, tuple) else (right,))


# str methods whose result can be much larger than the string: checked before they run
_GROWING_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "format", "format_map", "join"}


def _check_call(obj: Any, args, kwargs) -> None:
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if isinstance(owner, str) and name in _GROWING_METHODS:
        if name in ("format", "format_map"):
            _check_format(owner, args)
            _check_int_args(kwargs.values())
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            grows = (len(args[1]) - len(args[0])) * (owner.count(args[0]) if args[0] else len(owner) + 1)
            if len(owner) + grows > MAX_RENDER_CHARS:
                raise _too_big("replace()", len(owner) + grows)
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int) and owner.count("\t") * tab > MAX_RENDER_CHARS:
                raise _too_big("expandtabs()", owner.count("\t") * tab)
        else:
            _check_int_args(args)
            _check_int_args(kwargs.values())
    else:
        _check_int_args(args)
        _check_int_args(kwargs.values())


def _bounded_filter(name: str, fn: Callable) -> Callable:
    """A filter that cannot make a huge value from a small one, and whose result is counted."""

    growing = name in ("center", "indent", "format", "replace")

    @functools.wraps(fn)  # keeps jinja_pass_arg (pass_context, pass_environment, ...)
    def bounded(*args, **kwargs):
        if growing:
            values = [a for a in args if not hasattr(a, "filters")]  # the environment, passed to some
            if name == "indent":
                s = values[0] if values and isinstance(values[0], str) else ""
                width = values[1] if len(values) > 1 else kwargs.get("width", 4)
                per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
                if len(s) + (s.count("\n") + 1) * per_line > MAX_RENDER_CHARS:
                    raise _too_big("the indent filter", len(s) + (s.count("\n") + 1) * per_line)
            elif name == "format" and values and isinstance(values[0], str):
                _check_format(values[0], values[1:])
            elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
                s, old, new = values[:3]
                grows = (len(new) - len(old)) * (s.count(old) if old else len(s) + 1)
                if len(s) + grows > MAX_RENDER_CHARS:
                    raise _too_big("the replace filter", len(s) + grows)
            else:
                _check_int_args(values[1:])
            _check_int_args(kwargs.values())
        result = fn(*args, **kwargs)
        _charge_value(result)
        return result

    return bounded


class BoundedNamespace(Namespace):
    """``namespace()`` of the templates: what is stored in it is counted (``ns.x = ns.x ~ ns.x``
    in a loop doubles a string each time)."""

    def __setitem__(self, name: str, value: Any) -> None:
        _charge(_size(value))  # every store counts: a doubling starts small
        super().__setitem__(name, value)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with the size checks above (the time limit is ``guarded``'s)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        super().__init__(**options)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace
        self.concat = _bounded_concat

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        _charge_value(result)
        return result

    def call(__self, __context, __obj, *args, **kwargs):
        _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _charge_value(result)
        return result


def _bounded_concat(parts) -> str:
    """``"".join`` of a template's (or block's) output, refused past MAX_RENDER_CHARS before
    the text is made (the chunks themselves are values the render made, within its budget)."""
    if parts.__class__ is not list:
        parts = list(parts)
    total = sum(map(len, parts))
    if total > MAX_RENDER_CHARS:
        raise _too_big("the rendered text", total)
    return "".join(parts)


# --------------------------------------------------------------------------- the time limit


class _Watchdog:
    """One daemon thread that interrupts renders past their deadline, in whichever thread.

    The hot path (``guarded``, once per Jinja2 render) takes no lock: each running render
    has an entry in ``_ARMED`` holding a one-item claim list, and whoever pops it first
    (``guarded`` at the end of the render, or the watchdog past the deadline: ``list.pop``
    is atomic under the GIL) decides. When the watchdog wins, ``guarded`` waits for its
    exception to be set, clears it and raises RenderTimeout itself, so it never lands
    after the guard.
    """

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="render-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_SECONDS)
            now = _monotonic()
            for tid, entry in list(_ARMED.items()):
                if now > entry[0] and entry[1]:
                    try:
                        entry[1].pop()
                    except IndexError:
                        continue  # the render ended meanwhile
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(RenderTimeout))
                    entry[2].append(True)


_WATCHDOG = _Watchdog()


def _after_fork() -> None:  # a forked child has no watchdog thread, and no render of its parent's threads
    global _WATCHDOG
    _ARMED.clear()
    _WATCHDOG = _Watchdog()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def guarded(render: Callable, *args) -> Any:
    """``render(*args)`` within the time and size limits; RenderTimeout or RenderTooLarge
    (MemoryError becomes RenderTooLarge). A render inside a render shares its limits."""
    tid = _get_ident()
    current = _ARMED.get(tid)
    if current is not None and current[1]:  # nested (a macro, a filter step): the outer guard bounds it
        return render(*args)
    if _WATCHDOG._thread is None:
        _WATCHDOG.start()
    entry = (_monotonic() + RENDER_TIMEOUT_SECONDS, [True], [], [ALLOC_BUDGET_CHARS])
    _ARMED[tid] = entry
    try:
        return render(*args)
    except MemoryError:
        raise RenderTooLarge("the render ran out of memory") from None
    finally:
        try:
            entry[1].pop()  # the render's end claims it: the watchdog will not fire
        except IndexError:  # the watchdog claimed it first: its exception is (being) set
            while not entry[2]:
                time.sleep(0.001)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
            raise RenderTimeout() from None


def limit_message(e: BaseException) -> tuple[str, str]:
    """(row error class, message) of a RenderTimeout or RenderTooLarge."""
    if isinstance(e, RenderTimeout):
        return TIMEOUT_KIND, f"the render ran past {RENDER_TIMEOUT_SECONDS:g} s (loops too long for one row?)"
    return TOO_LARGE_KIND, str(e) or f"the render is larger than {MAX_RENDER_CHARS} characters"


# --------------------------------------------------------------------------- preflight


def _const_int(node) -> int | None:
    if isinstance(node, nodes.Const) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    try:
        value = node.as_const()
    except Exception:  # noqa: BLE001 - not a constant
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _loop_bound(node: nodes.For) -> int:
    """The most iterations a loop can run when its source says (a range of constants), else 1
    (a loop over the row's data is bounded by the row)."""
    it = node.iter
    if isinstance(it, nodes.Call) and isinstance(it.node, nodes.Name) and it.node.name == "range" and not it.kwargs:
        values = [_const_int(a) for a in it.args]
        if values and None not in values:
            try:
                return min(len(range(*values)), MAX_RANGE)
            except (TypeError, ValueError):
                return 1
    return 1


def _iterations(node, outer: int = 1) -> int:
    """The largest product of constant loop bounds along any nesting of ``node``'s loops."""
    worst = outer
    for child in node.iter_child_nodes():
        if isinstance(child, nodes.For):
            worst = max(worst, _iterations(child, outer * _loop_bound(child)))
        else:
            worst = max(worst, _iterations(child, outer))
    return worst


def cost_problems(ast, where: str) -> list[str]:
    """What a template's source shows to be beyond a render's limits: nested constant loops,
    a constant repetition, width or power too large."""
    problems = []
    steps = _iterations(ast)
    if steps > MAX_STATIC_LOOP_ITERATIONS:
        problems.append(
            f"{where}: its loops run up to {steps:,} iterations per row (nested loops over constant ranges); "
            f"a render may take {RENDER_TIMEOUT_SECONDS:g} s, so this row would fail as {TIMEOUT_KIND}: "
            "loop over the row's data, or over smaller ranges"
        )
    for node in ast.find_all(nodes.BinExpr):
        left, right = _const_int(node.left), _const_int(node.right)
        if isinstance(node, nodes.Mul):
            n = left if left is not None else right
            if n is not None and n > MAX_RENDER_CHARS:
                problems.append(f"{where}: repeats a value {n:,} times; a render may make at most {MAX_RENDER_CHARS:,} characters")
        elif (
            isinstance(node, nodes.Pow)
            and left is not None
            and right is not None
            and abs(left) > 1
            and right * left.bit_length() > MAX_INT_BITS
        ):
            problems.append(f"{where}: {left} ** {right} is a number too large to compute in a render")
    for node in ast.find_all((nodes.Call, nodes.Filter)):
        for arg in [*node.args, *(kw.value for kw in node.kwargs)]:
            n = _const_int(arg)
            if n is not None and abs(n) > MAX_RENDER_CHARS:
                problems.append(
                    f"{where}: an argument of {n:,} (a width or count) is beyond the {MAX_RENDER_CHARS:,} characters a render may make"
                )
    for node in ast.find_all(nodes.Const):
        if isinstance(node.value, str) and ("{" in node.value or "%" in node.value):
            for m in _WIDTH.finditer(node.value):
                if int(m.group(0)) > MAX_RENDER_CHARS:
                    problems.append(
                        f"{where}: a format width of {int(m.group(0)):,} is beyond the {MAX_RENDER_CHARS:,} characters a render may make"
                    )
    return list(dict.fromkeys(problems))


__all__ = [
    "ALLOC_BUDGET_CHARS", "BoundedSandbox", "MAX_RENDER_CHARS", "RENDER_TIMEOUT_SECONDS", "RenderTimeout", "RenderTooLarge",
    "TIMEOUT_KIND", "TOO_LARGE_KIND", "cost_problems", "guarded", "limit_message",
]  # fmt: skip
