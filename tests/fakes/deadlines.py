"""Running a call that may hang, for tests of deadlines: the test itself must never hang."""

from __future__ import annotations

import threading


def run_with_deadline(fn, seconds: float):
    """fn() in a daemon thread; (finished, its result or exception) after at most ``seconds``."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["value"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("value")
