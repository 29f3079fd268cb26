"""Run by tests/test_real_sglang.py with the real-sglang interpreter (build/venv-sglang):
our engine code against the installed sglang 0.5.23. Prints one JSON object: check name ->
{"ok": bool, "detail": ...}. ``sigquit`` mode instead checks the SIGQUIT handler install
(and that a reload's engine, built off the main thread, leaves it in place)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import traceback
import types
import warnings
from pathlib import Path

warnings.simplefilter("ignore")
HERE = Path(__file__).resolve().parent

RESULTS: dict = {}


def check(fn):
    try:
        detail = fn()
        RESULTS[fn.__name__] = {"ok": True, "detail": detail}
    except BaseException:  # noqa: BLE001 - reported (argparse exits)
        RESULTS[fn.__name__] = {"ok": False, "detail": traceback.format_exc()}
    return fn


def processor(max_restarts=3, **server_args):
    from mirageflow.config import ProcessorConfig, ServerArgs

    args = {"model_path": "/models/m", "tp_size": 2, "dp_size": 1, "trust_remote_code": True,
            "disable_custom_all_reduce": False, "extra_engine_args": {}}  # fmt: skip
    args.update(server_args)
    return ProcessorConfig(
        type="llm", backend="sglang", server_args=ServerArgs(**args), sampling_params={}, chat_template_kwargs={},
        apply_chat_template=False, torch_threads=None, max_restarts=max_restarts,
    )  # fmt: skip


EXTRA = {"max_running_requests": 64, "mem_fraction_static": 0.8, "chunked_prefill_size": 4096, "context_length": 8192,
         "grammar_backend": "xgrammar", "random_seed": 7, "enable_metrics": True, "log_level": "warning",
         "schedule_policy": "lpm", "schedule_conservativeness": 0.5}  # fmt: skip


def run_all() -> None:
    @check
    def engine_kwargs_build_a_real_server_args():
        from sglang.srt.server_args import ServerArgs

        from mirageflow.engines.sglang_common import engine_kwargs
        from mirageflow.engines.sglang_engine import SGLangEngine

        kwargs = engine_kwargs(processor(extra_engine_args=EXTRA).server_args)
        kwargs["custom_sigquit_handler"] = SGLangEngine(processor())._on_sigquit
        args = ServerArgs(**kwargs)  # a misspelt or removed field is a TypeError here
        wrong = {k: (getattr(args, k), v) for k, v in kwargs.items() if getattr(args, k) != v}
        assert not wrong, wrong
        return sorted(kwargs)

    @check
    def server_command_parses_back_to_the_same_values():
        from sglang.srt.server_args import prepare_server_args

        from mirageflow.engines.sglang_server import SGLangServerEngine

        engine = SGLangServerEngine(processor(extra_engine_args=EXTRA))
        argv = engine.build_command(31234)[3:]  # after python -m sglang.launch_server
        args = prepare_server_args(argv)
        expected = {"model_path": "/models/m", "host": "127.0.0.1", "port": 31234, "tp_size": 2, "dp_size": 1,
                    "trust_remote_code": True, "disable_custom_all_reduce": False, **EXTRA}  # fmt: skip
        wrong = {k: (getattr(args, k), v) for k, v in expected.items() if getattr(args, k) != v}
        assert not wrong, wrong
        return argv

    @check
    def finish_reasons_from_the_real_finish_classes():
        from sglang.srt.managers.schedule_batch import (
            FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN, FINISHED_MATCHED_REGEX,
        )  # fmt: skip

        from mirageflow.engines.sglang_common import completion_from_output

        def complete(reason):
            meta = {"id": "r", "finish_reason": reason.to_json(), "prompt_tokens": 5, "completion_tokens": 3}
            c = completion_from_output(0, {"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta})
            return [c.finish_reason, c.error_kind]

        got = {
            "token": complete(FINISH_MATCHED_TOKEN(2)), "str": complete(FINISH_MATCHED_STR("\n")),
            "regex": complete(FINISHED_MATCHED_REGEX("x")), "length": complete(FINISH_LENGTH(3)),
            "abort": complete(FINISH_ABORT()),
            "grammar": complete(FINISH_ABORT("Grammar accept_token failed: bad token", 500, "InternalServerError")),
            "too_long": complete(FINISH_ABORT("Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens).")),
        }  # fmt: skip
        assert got == {"token": ["stop", None], "str": ["stop", None], "regex": ["stop", None], "length": ["length", None],
                       "abort": ["abort", "aborted"], "grammar": ["abort", "grammar_error"],
                       "too_long": ["abort", "context_length"]}, got  # fmt: skip
        return got

    @check
    def errors_raised_by_the_real_abort_path():
        """tokenizer_manager._handle_abort_finish_reason raises ValueError (400) or HTTPException."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.managers.utils import validate_input_length

        from mirageflow.engines.sglang_common import request_error

        too_long = validate_input_length(types.SimpleNamespace(origin_input_ids=[0] * 9000), 8192, False)
        manager = types.SimpleNamespace(rid_to_state={}, _release_lora_once=lambda state: None)
        state = types.SimpleNamespace(obj=types.SimpleNamespace(rid="r"))
        cases = {
            "grammar": FINISH_ABORT("Grammar accept_token failed: token 7", 500, "InternalServerError"),
            "too_long": FINISH_ABORT(too_long),  # status 400 as set_finish_with_abort's default
            "kv_budget": FINISH_ABORT("Request prompt exceeds the KV memory budget: input_len=9000.", 400),
            "other_500": FINISH_ABORT("The sampling backend did not return captured sampling support.", 500),
        }
        got = {}
        for name, reason in cases.items():
            reason_json = reason.to_json()
            if reason_json["status_code"] is None:
                reason_json["status_code"] = 400
            out = {"meta_info": {"finish_reason": reason_json}}
            try:
                asyncio.run(TokenizerManager._handle_abort_finish_reason(manager, out, state, False))
                raise AssertionError(f"{name}: nothing raised")
            except Exception as e:  # noqa: BLE001
                c = request_error(0, e)
                got[name] = [type(e).__name__, c and c.error_kind]
        assert got == {"grammar": ["HTTPException", "grammar_error"], "too_long": ["ValueError", "context_length"],
                       "kv_budget": ["ValueError", "context_length"], "other_500": ["HTTPException", "aborted"]}, got  # fmt: skip
        import inspect

        from sglang.srt.managers import scheduler

        assert "exceeds the KV memory budget" in inspect.getsource(scheduler)  # the message we match
        from fastapi import HTTPException

        assert request_error(0, HTTPException(503, "busy")).error_kind == "aborted"
        assert request_error(0, RuntimeError("scheduler died")) is None  # not a row error: the shard fails
        return got

    @check
    def one_bos_through_the_real_tokenization_path():
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        from mirageflow.engines.tokens import PromptTokenizer

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("user hello assistant".split())}}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        prompt = "<s> user hello assistant"  # a rendered template that starts with BOS
        stub = types.SimpleNamespace(tokenizer=tok, async_dynamic_batch_tokenizer=None,
                                     model_config=types.SimpleNamespace(is_embedding_gemma=False))  # fmt: skip
        for name in ("_detect_input_format", "_prepare_tokenizer_input", "_extract_tokenizer_results"):
            setattr(stub, name, types.MethodType(getattr(TokenizerManager, name), stub))
        as_text, _ = asyncio.run(TokenizerManager._tokenize_texts(stub, prompt))
        ours = PromptTokenizer(tok)(prompt)
        raw_prompt = PromptTokenizer(tok)("user hello")
        request = GenerateReqInput(input_ids=ours, sampling_params={})
        request.normalize_batch_and_arguments()
        assert as_text[:2] == [1, 1], as_text  # SGLang's own path: two BOS
        assert ours[0] == 1 and ours.count(1) == 1, ours
        assert raw_prompt[0] == 1 and raw_prompt.count(1) == 1, raw_prompt
        assert request.input_ids == ours  # ids are used as given
        return {"sglang_text_path": as_text, "ours": ours}

    @check
    def generate_body_passes_the_contract_gate():
        from sglang.srt.entrypoints.api_contract import generate_contract_error

        from mirageflow.engines.wire import Request
        from mirageflow.engines.sglang_common import sampling_params

        params = sampling_params(Request(0, None, "x", {"max_new_tokens": 8, "temperature": 0.0, "stop": ["\n"]}, '{"type": "object"}'))
        assert generate_contract_error({"input_ids": [1, 5, 6], "sampling_params": params}) is None
        assert generate_contract_error({"text": "x", "sampling_params": params}) is None
        return params

    @check
    def json_after_a_response_prefix_through_the_real_grammar_backend():
        """The continuation grammar we send for a JSON output with a prefix passes SGLang's
        request checks, compiles in its xgrammar backend (the key the grammar manager makes
        of ``ebnf``), accepts the rest of the JSON and rejects a restarted object, which
        the schema's own grammar (what a prefix got before) would demand."""
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar, XGrammarGrammarBackend
        from sglang.srt.entrypoints.api_contract import generate_contract_error
        from sglang.srt.sampling.sampling_params import SamplingParams

        from mirageflow.engines.wire import Request
        from mirageflow.engines.sglang_common import sampling_params
        from mirageflow.model_prep import _train_tiny_tokenizer

        tok = _train_tiny_tokenizer()  # the tiny model's byte-level BPE
        schema = json.dumps({"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
                             "required": ["answer", "score"], "additionalProperties": False})  # fmt: skip
        prefix, rest = '{"answer": ', '"yes", "score": 3}'
        params = sampling_params(Request(0, None, "x " + prefix, {"max_new_tokens": 32}, schema, response_prefix=prefix))
        assert "json_schema" not in params, params
        assert generate_contract_error({"input_ids": [1, 5, 6], "sampling_params": params}) is None
        SamplingParams(**params).verify(len(tok))
        backend = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])

        def run(key, text):
            grammar = backend._init_value_dispatch(key, False)
            assert isinstance(grammar, XGrammarGrammar), grammar
            try:
                for t in tok(text, add_special_tokens=False)["input_ids"]:
                    grammar.accept_token(t)
                grammar.accept_token(tok.eos_token_id)
            except ValueError:
                return "rejected"
            return "terminated" if grammar.is_terminated() else "open"

        ebnf, json_key = ("ebnf", params["ebnf"]), ("json", schema)
        got = {"continuation": run(ebnf, rest), "restart": run(ebnf, prefix + rest),
               "schema_grammar_continuation": run(json_key, rest), "schema_grammar_restart": run(json_key, prefix + rest)}  # fmt: skip
        assert got == {"continuation": "terminated", "restart": "rejected",
                       "schema_grammar_continuation": "rejected", "schema_grammar_restart": "terminated"}, got  # fmt: skip
        return got

    @check
    def scraped_metric_names_exist():
        import inspect

        from sglang.srt.observability import metrics_collector

        from mirageflow.engines.sglang_server import METRICS

        source = inspect.getsource(metrics_collector)
        missing = [m for m in METRICS if f'"{m}"' not in source]
        assert not missing, missing
        return METRICS

    @check
    def a_subprocess_killed_without_a_word_is_classified_from_the_watchdogs_line():
        """SGLang's SubprocessWatchdog logs a dead child's exit code and signals SIGQUIT: the
        line it logs is what server_process.classify_crash reads the class from."""
        import logging

        from sglang.srt.utils.watchdog import SubprocessWatchdog

        from mirageflow.engines.server_process import classify_crash

        lines, signals = [], []

        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        logger = logging.getLogger("sglang.srt.utils.watchdog")
        logger.addHandler(Keep())
        previous = signal.signal(signal.SIGQUIT, lambda signum, frame: signals.append(signum))
        try:
            dead = types.SimpleNamespace(is_alive=lambda: False, exitcode=-9, pid=4242)
            assert SubprocessWatchdog([dead], ["scheduler_0"])._check_processes() is True
        finally:
            signal.signal(signal.SIGQUIT, previous)
        assert signals == [signal.SIGQUIT], signals
        got = classify_crash("\n".join(lines))
        assert [str(got[0]), got[1]] == ["killed_by_signal", "a subprocess killed by SIGKILL"], (lines, got)
        return lines

    @check
    def shutdown_stops_the_watchdog_before_it_kills_the_children():
        """A reload shuts the dead engine down: its watchdog must stop first, or the children
        shutdown kills would be reported (SIGQUIT) as the successor's death."""
        import inspect

        from sglang.srt.entrypoints.engine import Engine

        source = inspect.getsource(Engine.shutdown)
        stop, kill = source.index("_subprocess_watchdog.stop()"), source.index("kill_process_tree(os.getpid(), include_parent=False")
        assert stop < kill, source
        return "watchdog stopped, then kill_process_tree"

    @check
    def a_dead_tokenizer_managers_loop_tasks_are_its_asyncio_tasks():
        """A reload cancels the dead engine's tasks in our loop: the ones its tokenizer manager
        keeps in ``asyncio_tasks`` (a task that raised would kill the process)."""
        import inspect

        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        source = inspect.getsource(TokenizerManager.auto_create_handle_loop)
        assert source.count("self.asyncio_tasks.add(") == source.count("loop.create_task(") >= 2, source
        return "handle_loop and sigterm_watchdog in asyncio_tasks"

    @check
    def the_fakes_facts_match_the_package():
        from fakes.make_sglang_facts import facts

        stored = json.loads((HERE / "fakes" / "sglang_facts.json").read_text())
        assert facts() == stored, "tests/fakes/sglang_facts.json is stale: regenerate it (see its script)"
        return stored["sglang"]


def sigquit(mode: str) -> None:
    """SGLang's own handler installation (engine.py _set_envs_and_config), then SIGQUIT as a
    failing scheduler sends it. With our handler the process lives and the engine fails its
    requests; with SGLang's default it is killed."""
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import ServerArgs

    from mirageflow.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine(processor(max_restarts=0))
    engine.engine = types.SimpleNamespace(shutdown=lambda: None, tokenizer_manager=None)  # "loaded"
    engine._serving = True
    engine._start_loop("test")
    handler = engine._on_sigquit if mode == "ours" else None
    _set_envs_and_config(ServerArgs(model_path=tempfile.gettempdir(), custom_sigquit_handler=handler))
    if mode == "ours":  # a reload builds its sglang.Engine off the main thread: SGLang leaves our handler there
        import threading

        reload = threading.Thread(
            target=_set_envs_and_config, args=(ServerArgs(model_path=tempfile.gettempdir(), custom_sigquit_handler=handler),)
        )
        reload.start()
        reload.join()
        assert signal.getsignal(signal.SIGQUIT) == engine._on_sigquit, signal.getsignal(signal.SIGQUIT)
    os.kill(os.getpid(), signal.SIGQUIT)
    try:
        engine.generate([__import__("mirageflow.engines.wire", fromlist=["Request"]).Request(0, None, "x", {})])
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"alive": True, "error": f"{type(e).__name__}: {e}"}))
        return
    print(json.dumps({"alive": True, "error": None}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["sigquit"]:
        sigquit(sys.argv[2])
    else:
        run_all()
        print(json.dumps(RESULTS))
