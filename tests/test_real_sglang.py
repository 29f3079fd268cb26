"""Our SGLang code against the real sglang 0.5.23 package (not the fakes), on the CPU.

The package lives in its own environment (build/venv-sglang, made by
``python tests/real_sglang_env.py build``; .ci/run does it): sglang without its GPU
dependencies, on our CPU torch. The checks run in that interpreter
(tests/real_sglang_checks.py) and report here. Without the environment the tests skip and
say why; with ``MIRAGEFLOW_REQUIRE_REAL_SGLANG=1`` (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import real_sglang_env

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.real_sglang


def _need_env() -> None:
    error = real_sglang_env.check()
    if error is None:
        return
    message = f"REAL SGLANG TESTS NOT RUN: {error}"
    if os.environ.get("MIRAGEFLOW_REQUIRE_REAL_SGLANG") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(real_sglang_env.PYTHON), str(HERE / "real_sglang_checks.py"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=HERE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def results() -> dict:
    _need_env()
    proc = _run()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the real-sglang checks did not run (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


CHECKS = [
    "engine_kwargs_build_a_real_server_args",
    "server_command_parses_back_to_the_same_values",
    "finish_reasons_from_the_real_finish_classes",
    "errors_raised_by_the_real_abort_path",
    "one_bos_through_the_real_tokenization_path",
    "generate_body_passes_the_contract_gate",
    "json_after_a_response_prefix_through_the_real_grammar_backend",
    "scraped_metric_names_exist",
    "a_subprocess_killed_without_a_word_is_classified_from_the_watchdogs_line",
    "shutdown_stops_the_watchdog_before_it_kills_the_children",
    "a_dead_tokenizer_managers_loop_tasks_are_its_asyncio_tasks",
    "the_fakes_facts_match_the_package",
]


@pytest.mark.parametrize("name", CHECKS)
def test_against_the_real_package(results, name):
    result = results[name]
    assert result["ok"], f"{name}:\n{result['detail']}"


def test_our_sigquit_handler_keeps_the_shard_alive_with_a_clear_error(tmp_path):
    """SGLang installs our handler (custom_sigquit_handler); its own would kill the process. A
    reload's sglang.Engine, built off the main thread, leaves ours in place."""
    _need_env()
    ours = _run("sigquit", "ours")
    assert ours.returncode == 0, ours.stderr[-3000:]
    outcome = json.loads(ours.stdout.strip().splitlines()[-1])
    assert outcome["error"].startswith(  # max_restarts=0 there: not reloaded (a real Engine cannot start on the CPU)
        "SGLangCrashed: the SGLang engine died 1 times and was reloaded 0 times (processors[].max_restarts=0: not reloaded): "
    )
    assert ": an SGLang subprocess failed and signalled SIGQUIT: a subprocess failed" in outcome["error"]
    theirs = _run("sigquit", "sglang")
    assert theirs.returncode == -9, (theirs.returncode, theirs.stderr[-3000:])  # what the old code got
    assert "Received sigquit from a child process" in theirs.stderr
