"""The engine interface every backend implements, what a backend can do, and the engine errors.

The shard runner keeps up to ``max_inflight`` rows in flight and awaits one
``generate_one`` per request, so an engine is never drained between batches: a
continuous-batching engine (SGLang, an HTTP server) takes each request as it comes, and a
batched engine (transformers) groups whatever is waiting. ``generate`` is a synchronous
convenience for tests and benchmarks.

What a backend can do is said by class attributes with defaults here: callers read
``engine.templates_server_side``, never ``getattr(engine, ..., default)``. The same static facts are in the backend's registry line
(engines/registry.py), where the config checks read them without importing the engine.

Next to this module: the wire types (``wire``), the chat-template renderer
(``chat_template``), prompt token ids (``tokens``), the registry and backend selection
(``registry``) and the private event loop of the engines that run one (``loop``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Iterable

from mirageflow.engines.chat_template import ChatTemplate
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.errors import MirageflowError


class Engine(abc.ABC):
    """Load once, apply the model's chat template, generate request by request, close."""

    @staticmethod
    def key_tokenizer(server_args):
        """The tokenizer whose chat template the engine applies, without the weights; only for an
        engine that declares ``tokenizer_without_weights``."""
        raise NotImplementedError("this engine cannot load its tokenizer without its model")

    max_inflight: int = 64  # rows the runner keeps in flight; engines set it from their capacity
    # How often the runner commits finished rows (execution_params.checkpoint_seconds), set
    # before load(): an engine whose rows come back in batches ends each batch within it, so a
    # stop loses at most one interval of work. None: no runner commits (tests, benchmarks).
    commit_seconds: float | None = None
    # how create_engine chose this backend ({"requested", "chosen", "reason"}); shown in
    # info.details["backend_selection"] (status.json -> engines)
    backend_selection: dict | None = None

    # ---- what the backend can do (static ones also in its registry line: engines/registry.py)
    # The server applies the chat template: requests carry the messages, chat_prompt only shows them.
    templates_server_side: bool = False
    # One request with n answers a row's samples (processors[].native_n; see native_samples).
    native_n: bool = False
    # The model at server_args.model_path is loaded on this node, by the engine or a server it
    # launches (the driver checks the directory; an engine service can share it). False: a
    # remote server has it, and model_path is only its name.
    loads_model: bool = True
    # processors[].base_url is required (the endpoint to send requests to).
    needs_base_url: bool = False
    # JSON outputs are constrained in this process by the xgrammar package (the driver checks
    # it is installed before any job; a server constrains with its own).
    grammar_in_process: bool = False
    # The chat template's tokenizer loads without the model's weights (key_tokenizer): the
    # request cache's keys of a chat-templated prompt can be made before the model is loaded.
    tokenizer_without_weights: bool = False
    # One engine can span the nodes of a job (execution_params.nodes > 1): rank 0 here, the
    # other ranks started by srun on the other nodes (engines/server_ranks.py).
    spans_nodes: bool = False
    provider_api: bool = False  # a provider's API that charges per token (registry.Capabilities)
    # warmup() does work (compile, capture graphs): the runner times it as the warmup phase.
    warms_up: bool = False
    # Keeps work of its own in the shard's checkpoint across attempts (a provider's batches):
    # the runner calls bind_state(checkpoint, shard_id, samples) before load().
    keeps_state: bool = False
    # The GPUs this engine counts when they are not the job's own: a served shard's share of
    # its engine service's GPUs (1/K of them). None: the job's GPUs.
    gpu_share: float | None = None
    # Where an engine that paces its requests under processors[].max_requests_per_minute and
    # max_tokens_per_minute shares that pace with the run's other shards (transport/rate_limit.py):
    # set by the runner before load(); None: this process's own pace.
    rate_limit_file: Path | None = None
    # The run's spend ledger under execution_params.max_cost_usd (transport/spend.py): set by the
    # runner before load() for a processor with a known price; None: no budget holds its requests.
    spend_ledger: Any = None
    # The Hugging Face tokenizer, once loaded, for engines that have one (chat_prompt's default).
    tokenizer: Any = None

    @property
    def info(self) -> EngineInfo:
        info = self.__dict__["_info"]
        if self.backend_selection and "backend_selection" not in info.details:
            info.details["backend_selection"] = dict(self.backend_selection)
        return info

    @info.setter
    def info(self, value: EngineInfo) -> None:
        self.__dict__["_info"] = value

    @abc.abstractmethod
    def load(self) -> None: ...

    def bind_state(self, checkpoint, shard_id: int, samples: int = 1) -> None:  # noqa: B027 - engines with keeps_state override it
        """Where an engine with ``keeps_state`` keeps it (called after the checkpoint's restore)."""

    def chat_prompt(self, messages: list[dict[str, str]], chat_template_kwargs: dict) -> str:
        """The model input for chat messages, through the model's own chat template.

        Default: ``self.tokenizer``'s template compiled once (``ChatTemplate``), the same
        text as ``tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True, **chat_template_kwargs)`` at a fraction of its per-call
        cost. Engines without a Hugging Face tokenizer override this.
        """
        template = self.__dict__.get("_chat_template")
        if template is None:
            if self.tokenizer is None:
                raise NotImplementedError(f"{type(self).__name__} has no tokenizer to apply a chat template with")
            template = self._chat_template = ChatTemplate(self.tokenizer)
        return template(messages, chat_template_kwargs)

    def warmup(self) -> None:  # noqa: B027 - engines with warms_up = True override it
        """Warm up after load (compile, capture graphs), timed by the runner as the warmup phase."""

    @abc.abstractmethod
    async def generate_one(self, request: Request) -> Completion:
        """Generate one request; called concurrently, up to max_inflight at a time."""

    @property
    def native_samples(self) -> bool:
        """Whether ``generate_samples`` asks once, with n, for a row's samples (a backend
        with ``native_n`` says from its processor's ``native_n``)."""
        return False

    async def generate_samples(self, request: Request, n: int) -> list[Completion]:
        """``n`` samples of one request (n_samples: consecutive samples of one row), sample k
        with id ``request.id + k`` and seed ``request.seed + k``. Here: n requests at once.
        Engines with native ``n`` (one request, n choices) override this."""
        if n == 1:
            return [await self.generate_one(request)]
        return list(
            await asyncio.gather(
                *(
                    self.generate_one(
                        dataclasses.replace(request, id=request.id + k, seed=None if request.seed is None else request.seed + k)
                    )
                    for k in range(n)
                )
            )
        )

    def queue_depth(self) -> int | None:
        """Requests waiting or running inside the engine, when it can tell."""
        return None

    def restarts(self) -> int:
        """How many times this job restarted the engine's launched server (engines/server_restarts.py)."""
        return 0

    def deaths(self) -> list[dict]:
        """Each death of the engine's launched server in this job: its class, time, cause, exit
        code and the requests sent again to its successor (engines/server_restarts.py)."""
        return []

    def stop(self) -> None:  # noqa: B027 - engines without long calls have nothing to interrupt
        """Interrupt running generation soon (called on SIGTERM/SIGINT, from any thread)."""

    def close(self) -> None:  # noqa: B027 - optional for engines without resources
        pass

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """All requests at once, in input order (tests, benchmarks)."""

        async def run():
            return await asyncio.gather(*(self.generate_one(r) for r in requests))

        return list(asyncio.run(run()))

    def __enter__(self):
        self.load()
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- errors


class EngineError(MirageflowError, RuntimeError):
    """The engine cannot go on (it crashed, the server died, the endpoint is unusable): the
    shard fails with this message. Row-level problems are Completions with ``error_kind``."""


class EngineDied(EngineError):
    """The engine died and is not brought back (its restarts are spent, or its death is one a
    restart cannot help): ``death_class`` is the last death's (an EngineDeathClass value),
    failure.json's ``failure_class``."""

    def __init__(self, message: str, death_class: str | None = None):
        super().__init__(message)
        self.death_class = death_class


def death_class_of(error: BaseException) -> str | None:
    """The death class an EngineDied (a launched server's ServerDied) carries, or the
    ``failure_class`` of another ending (transport/spend.BudgetExceeded's budget_exceeded),
    anywhere in ``error``'s chain of causes: failure.json's ``failure_class``."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = getattr(error, "death_class", None) or getattr(error, "failure_class", None)
        if found is not None:
            return str(found)
        error = error.__cause__ or error.__context__
    return None


class EngineStopped(EngineError):
    """``stop()`` was called (SIGTERM/SIGINT): outstanding and later requests fail with it."""
