"""A stand-in for the ``sglang`` package, injected as ``sys.modules["sglang"]`` by tests.

It behaves as sglang 0.5.23 does where our engine can tell (paths are under
``python/sglang/srt/``; tests/test_real_sglang.py checks the same points against the
installed package):

- ``Engine(**server_args)`` (entrypoints/engine.py): ``log_level`` defaults to "error";
  ``custom_sigquit_handler`` is installed for SIGQUIT when given, else a handler that kills
  the whole process tree including this process (``_set_envs_and_config`` ->
  ``kill_process_tree(os.getpid())``); neither outside the main thread (a warning only).
- ``generate``/``async_generate(prompt=None, sampling_params=None, input_ids=None, ...)``:
  one prompt -> one dict; ``{"text", "output_ids", "meta_info"}`` with ``id``,
  ``finish_reason`` (FINISH_*.to_json(): {"type": "stop", "matched"}, {"type": "length",
  "length"}, {"type": "abort", "message", "status_code", "err_type"}), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``e2e_latency``.
- A text prompt is tokenized with ``add_special_tokens=True`` (tokenizer_manager.py
  ``_tokenize_texts`` calls ``self.tokenizer(texts)``): the fake tokenizer adds a BOS like
  Llama's, so a template that starts with ``<s>`` gets two. ``input_ids`` are used as given.
- ``image_data`` (a data URI or a list of them) with a text prompt: the placeholders
  ``<image>`` in the text must match the images one to one (see ``_check_images``); each
  image adds ``TOKENS_PER_IMAGE - 1`` to ``prompt_tokens`` (the placeholder expanded). The
  fake tokenizer's chat template writes ``<image>`` for each ``{"type": "image"}`` part.
- Sampling params: ``SamplingParams(**params)`` is a msgspec Struct: an unknown name raises
  TypeError ("Unexpected keyword argument"); names from tests/fakes/sglang_facts.json.
- Constrained output (fake_grammar.py): ``json_schema`` answers ``{"answer": "fake"}`` from
  its start, whatever the prompt ends with; ``ebnf`` is compiled by the real xgrammar and
  answered with the tail of that JSON the grammar accepts.
- Errors out of ``async_generate`` (tokenizer_manager.py ``_handle_abort_finish_reason``):
  ValueError for validation, a too-long input and scheduler aborts with status 400;
  ``HTTPException`` (fastapi's: ``status_code``, ``detail``) for aborts with another
  status, e.g. 500 "Grammar accept_token failed" (scheduler_components/
  batch_result_processor.py).
- The scheduler is a real child process (``Engine.scheduler``, a Popen; SGLang's is a
  multiprocessing "spawn" child): a scheduler crash is that child logging its traceback to
  the shared stderr, signalling SIGQUIT to its parent and exiting with code 0 (scheduler.py
  ``run_scheduler_process``: ``parent_process.send_signal(SIGQUIT)``, then it returns), and
  the request never answers. A scheduler killed without a word (the OOM killer) is noticed
  by the subprocess watchdog thread (utils/watchdog.py ``SubprocessWatchdog``: a child that
  exited with a code other than 0 -> "Subprocess scheduler_0 (pid=N) crashed with exit code
  -9. Triggering SIGQUIT for cleanup..." logged, SIGQUIT to this process).
- ``shutdown()`` stops the watchdog and kills the scheduler (SGLang's ``kill_process_tree(
  os.getpid(), include_parent=False)`` kills every child of the process; the fake kills only
  its own, so that it never touches the test's other children).
- The tokenizer manager binds its receive loop to the first event loop that generates
  (``auto_create_handle_loop``: a task kept in ``asyncio_tasks``); real SGLang then hangs on
  any other loop, this fake raises. From the main thread it also installs the running-phase SIGQUIT handler that
  kills the process tree (``SignalHandler.running_phase_sigquit_handler``).

Simulation: at most ``max_running_requests`` (default 4) requests run at once, the rest
queue; a request takes ``TOKEN_SECONDS`` per output token; output lengths vary with the
prompt. Magic words in a prompt (text or decoded ids): ``TOO_LONG`` (the tokenizer
manager's ValueError), ``SCHED_TOO_LONG`` and ``KV_BUDGET`` (the scheduler's length aborts,
status 400 -> ValueError), ``GRAMMAR_FAIL`` (HTTPException 500), ``ABORT`` (finish_reason
abort, no status), ``CRASH`` (the scheduler's exception: a CUDA error; SIGQUIT, no answer),
``SCHEDULER_KILLED`` (the scheduler gets SIGKILL; the watchdog's SIGQUIT, no answer): both
only in the first ``CRASHING_ENGINES`` engines started (None: all), answered like any prompt
in later ones; ``DEVICE_ERROR`` (``async_generate`` raises a CUDA error, in the same engines).
``model_path`` "fail-load" fails the
constructor; "crash-at-load" signals SIGQUIT, then fails as the real one does when its
scheduler died; "no-tokenizer" leaves ``tokenizer_manager`` None.

Everything is recorded on the module (``ENGINES``) and each engine (``calls``, ``answered``
(the prompts it answered), ``peak_in_flight``, ``peak_running``, ``shutdown_calls``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fakes.fake_grammar import GrammarFailure, constrained_answer

__version__ = "0.5.23+fake"

TOKEN_SECONDS = 0.0005
IMAGE_TOKEN = "<image>"  # the fake model's placeholder (a LLaVA's)
TOKENS_PER_IMAGE = 16  # what each placeholder expands to (counted in prompt_tokens)
ENGINES: list["Engine"] = []
CRASHING_ENGINES: int | None = None  # the first engines started that CRASH and SCHEDULER_KILLED crash (None: all)
SCHEDULER_TRACEBACK = "fake sglang scheduler: Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access"
# the scheduler child: waits for a word on stdin (its end: the engine is gone), then crashes as told
_SCHEDULER = f"""
import os, signal, sys
word = sys.stdin.readline().strip()
if word == "crash":
    print({SCHEDULER_TRACEBACK!r}, file=sys.stderr, flush=True)
    os.kill(os.getppid(), signal.SIGQUIT)
elif word == "die":
    os.kill(os.getpid(), signal.SIGKILL)
"""
_FACTS = json.loads((Path(__file__).with_name("sglang_facts.json")).read_text())
_SAMPLING_NAMES = set(_FACTS["sampling_params"])
_ids = itertools.count()


class HTTPException(Exception):
    """fastapi.HTTPException's shape (``status_code``, ``detail``, ``headers``)."""

    def __init__(self, status_code: int, detail=None, headers=None):
        super().__init__(status_code, detail)
        self.status_code, self.detail, self.headers = status_code, detail, headers


def kill_process_tree(parent_pid, include_parent: bool = True, skip_pid=None):
    """SGLang's utils.kill_process_tree, for this process: children are not simulated."""
    if include_parent and parent_pid == os.getpid():
        os.kill(os.getpid(), signal.SIGKILL)


class FakeTokenizer:
    """A Llama-like tokenizer: BOS ``<s>`` (id 1) added by ``__call__`` unless
    ``add_special_tokens=False``; a chat template that starts with ``<s>`` (as Llama 3,
    Gemma, Mistral); Hugging Face's apply_chat_template signature; records every call."""

    bos_token, bos_token_id, eos_token, eos_token_id = "<s>", 1, "</s>", 2

    def __init__(self):
        self.calls: list[dict] = []
        self.vocab = {"<s>": 1, "</s>": 2}
        self.words = {1: "<s>", 2: "</s>"}

    def _ids(self, text: str) -> list[int]:
        ids = []
        for word in text.replace("<s>", " <s> ").split():
            if word not in self.vocab:
                self.vocab[word] = len(self.vocab) + 1
                self.words[self.vocab[word]] = word
            ids.append(self.vocab[word])
        return ids

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        out = [([self.bos_token_id] if add_special_tokens else []) + self._ids(t) for t in texts]
        return {"input_ids": out[0] if isinstance(text, str) else out}

    def encode(self, text, add_special_tokens: bool = True):
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids) -> str:
        return " ".join(self.words.get(i, "?") for i in ids)

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template=None,
        add_generation_prompt=False,
        continue_final_message=False,
        tokenize=True,
        padding=False,
        truncation=False,
        max_length=None,
        return_tensors=None,
        return_dict=False,
        return_assistant_tokens_mask=False,
        tokenizer_kwargs=None,
        **kwargs,
    ):
        self.calls.append(
            {"messages": conversation, "tokenize": tokenize, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}
        )
        if tokenize:
            return [ord(c) % 256 for c in str(conversation)]
        # content parts (a VLM's template): one IMAGE_TOKEN per image part, where it stands
        text = "<s>" + "".join(f"<|{m['role']}|>{_content(m['content'])}\n" for m in conversation)
        if kwargs.get("enable_thinking") is False:
            text += "<|no_think|>"
        return text + ("<|assistant|>" if add_generation_prompt else "")


def _content(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(IMAGE_TOKEN if p["type"] == "image" else p["text"] for p in content)


def _check_images(prompt: str, image_data) -> int:
    """The images of one request; SGLang's multimodal processor (srt/multimodal/processors/
    base_processor.py ``load_mm_data``) counts the placeholders in the text and, when they
    differ from len(image_data), silently takes its legacy path instead of aligning them one
    to one: the fake refuses that instead, so a misalignment fails the tests. Each item
    must be something ``load_image`` (srt/utils/common.py) reads; the fake accepts data URIs."""
    import base64
    import io

    from PIL import Image

    images = [image_data] if isinstance(image_data, str) else list(image_data or [])
    found = prompt.count(IMAGE_TOKEN)
    if found != len(images):
        raise AssertionError(f"fake sglang: {found} image placeholders for {len(images)} image_data items")
    for item in images:
        assert isinstance(item, str) and item.startswith("data:image/"), f"fake sglang: image_data item is not a data URI: {str(item)[:40]}"
        Image.open(io.BytesIO(base64.b64decode(item.split(",", 1)[1]))).verify()
    return len(images)


class TokenizerManager:
    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.event_loop = None
        self.aborts: list[dict] = []
        self.asyncio_tasks: set[asyncio.Task] = set()  # its handle loop's task, as SGLang keeps it

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborts.append({"rid": rid, "abort_all": abort_all})

    async def handle_loop(self):
        """Waits on the detokenizer's socket; nothing comes in the fake."""
        await asyncio.get_running_loop().create_future()

    def auto_create_handle_loop(self):
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop = loop
            self.asyncio_tasks.add(loop.create_task(self.handle_loop()))
            if threading.current_thread() is threading.main_thread():
                # SignalHandler.running_phase_sigquit_handler: kill_process_tree(os.getpid())
                loop.add_signal_handler(signal.SIGQUIT, kill_process_tree, os.getpid())
        elif self.event_loop is not loop:
            raise RuntimeError(
                "fake sglang: the tokenizer manager's handle loop is bound to another event loop (real SGLang would hang here)"
            )


class Engine:
    def __init__(self, **kwargs):
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        kwargs.setdefault("log_level", "error")  # as SGLang does
        self.server_args = kwargs
        self.capacity = int(kwargs.get("max_running_requests") or 4)
        self.calls: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.running = self.peak_running = 0
        self.shutdown_calls = 0
        self.answered: list[str] = []
        self.scheduler: subprocess.Popen | None = None
        self._slots: asyncio.Semaphore | None = None
        ENGINES.append(self)
        # entrypoints/engine.py _set_envs_and_config: the SIGQUIT handler, main thread only
        self.sigquit_handler = None
        if threading.current_thread() is threading.main_thread():
            handler = kwargs.get("custom_sigquit_handler")
            if handler is None:

                def handler(signum, frame):  # launch_phase_sigquit_handler
                    kill_process_tree(os.getpid())

            signal.signal(signal.SIGQUIT, handler)
            self.sigquit_handler = handler
        if kwargs["model_path"] == "fail-load":
            raise RuntimeError("fake sglang: failed to load the model")
        if kwargs["model_path"] == "crash-at-load":
            # the scheduler logs its traceback, signals its parent and exits; the parent's
            # _wait_for_scheduler_ready then notices the dead process
            print(
                "fake sglang scheduler: torch.OutOfMemoryError: CUDA out of memory while allocating the KV cache",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGQUIT)
            time.sleep(0.05)
            raise RuntimeError(
                "Rank 0 scheduler died during initialization (exit code: 1). If exit code is -9 (SIGKILL), "
                "a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check."
            )
        self.tokenizer_manager = None if kwargs["model_path"] == "no-tokenizer" else TokenizerManager()
        self.scheduler = subprocess.Popen([sys.executable, "-c", _SCHEDULER], stdin=subprocess.PIPE)
        self._watchdog_stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_scheduler, name="subprocess-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        return_hidden_states=False,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        data_parallel_rank=None,
        rid=None,
    ):
        return self.loop.run_until_complete(
            self.async_generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, stream=stream, rid=rid)
        )

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        return_hidden_states=False,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        data_parallel_rank=None,
        rid=None,
    ):
        if self.tokenizer_manager is None:
            raise RuntimeError("fake sglang: engine without a tokenizer manager")
        self.tokenizer_manager.auto_create_handle_loop()
        if stream:
            raise NotImplementedError("fake sglang: streaming is not simulated")
        if (prompt is None) == (input_ids is None):
            raise ValueError("Either text or input_ids should be provided.")
        tokenizer = self.tokenizer_manager.tokenizer
        if prompt is not None:
            single = isinstance(prompt, str)
            ids = tokenizer(prompt)["input_ids"]  # add_special_tokens=True, as SGLang does
            ids = [ids] if single else ids
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [dict(sampling_params or {}) for _ in ids]
        n_images = 0
        if image_data is not None:
            if not single:
                raise NotImplementedError("fake sglang: image_data with a batch of prompts is not simulated")
            n_images = _check_images(tokenizer.decode(ids[0]), image_data)
        self.calls.append(
            {"prompt": prompt, "input_ids": ids[0] if single else ids, "sampling_params": sampling_params, "image_data": image_data}
        )
        extra = n_images * (TOKENS_PER_IMAGE - 1)
        outs = await asyncio.gather(*(self._one(tokenizer.decode(x), len(x) + extra, sp) for x, sp in zip(ids, params)))
        return outs[0] if single else list(outs)

    async def _one(self, prompt: str, n_prompt: int, params: dict) -> dict:
        unknown = set(params) - _SAMPLING_NAMES
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{sorted(unknown)[0]}'")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if params.get(k) is not None]
        if len(grammars) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if "json_schema" in params and not isinstance(params["json_schema"], str):
            raise TypeError(f"json_schema must be a JSON string, got {type(params['json_schema']).__name__}")
        if "SCHED_TOO_LONG" in prompt:  # the scheduler's abort (status 400) -> ValueError
            raise ValueError(
                "Input length (5000 tokens) exceeds the maximum allowed length (4096 tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        if "TOO_LONG" in prompt:
            raise ValueError("The input (5000 tokens) is longer than the model's context length (2048 tokens).")
        if "KV_BUDGET" in prompt:
            raise ValueError("Request prompt exceeds the KV memory budget: input_len=5000.")
        if "GRAMMAR_FAIL" in prompt:
            raise HTTPException(500, "Grammar accept_token failed: token 1234 is not accepted by the grammar")
        for word in ("SCHEDULER_KILLED", "CRASH"):  # the scheduler dies; this request never answers
            if word in prompt and self.crashes():
                try:
                    self.scheduler.stdin.write(b"die\n" if word == "SCHEDULER_KILLED" else b"crash\n")
                    self.scheduler.stdin.flush()
                except OSError:  # it died already (another request's word): no answer either
                    pass
                await asyncio.get_running_loop().create_future()
        if "DEVICE_ERROR" in prompt and self.crashes():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        start = time.monotonic()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            async with self._slots:
                self.running += 1
                self.peak_running = max(self.peak_running, self.running)
                try:
                    limit = int(params.get("max_new_tokens", 128))
                    wanted = 1 + sum(map(ord, prompt)) % 17  # variable output lengths
                    n = min(limit, wanted)
                    await asyncio.sleep(TOKEN_SECONDS * n)
                finally:
                    self.running -= 1
        finally:
            self.in_flight -= 1
        meta = {
            "id": f"fake-{next(_ids)}",
            "prompt_tokens": n_prompt,
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - start,
        }
        if "ABORT" in prompt:
            reason = {"type": "abort", "message": "fake abort: request was aborted", "status_code": None, "err_type": None}
            meta.update(completion_tokens=0, finish_reason=reason)
            return {"text": "", "output_ids": [], "meta_info": meta}
        if "json_schema" in params or "ebnf" in params:
            try:
                text = constrained_answer(params, '{"answer": "fake"}')
            except GrammarFailure as e:
                raise HTTPException(500, str(e)) from None
        else:
            text = " ".join(f"w{i}" for i in range(n))
        meta["finish_reason"] = {"type": "length", "length": n} if n >= limit else {"type": "stop", "matched": 2}
        self.answered.append(prompt)
        return {"text": text, "output_ids": list(range(n)), "meta_info": meta}

    def crashes(self) -> bool:
        """Whether CRASH and SCHEDULER_KILLED crash this engine (CRASHING_ENGINES)."""
        return CRASHING_ENGINES is None or ENGINES.index(self) < CRASHING_ENGINES

    def _watch_scheduler(self) -> None:
        """SubprocessWatchdog._monitor_loop: a child that exited with a code other than 0 -> SIGQUIT, once."""
        while not self._watchdog_stop.wait(0.02):
            rc = self.scheduler.poll()
            if rc is None or rc == 0:
                continue
            line = f"Subprocess scheduler_0 (pid={self.scheduler.pid}) crashed with exit code {rc}. Triggering SIGQUIT for cleanup...\n"
            os.write(2, line.encode())  # SGLang's logger: the process's stderr, the job log
            os.kill(os.getpid(), signal.SIGQUIT)
            return

    def shutdown(self):
        self.shutdown_calls += 1
        if self.scheduler is not None:  # the watchdog stops first, then the children go (Engine.shutdown)
            self._watchdog_stop.set()
            self._watchdog.join()
            self.scheduler.kill()
            self.scheduler.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
