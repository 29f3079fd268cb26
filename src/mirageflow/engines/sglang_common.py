"""What the two SGLang backends share (not an engine): engine arguments, parallelism,
sampling parameters, and SGLang's answers and errors mapped to Completions.

Checked against sglang 0.5.23 (tests/test_real_sglang.py runs these against the package).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from mirageflow.config.types import ServerArgs
from mirageflow.stats import formulas as stats
from mirageflow.engines.wire import BadAnswer, Completion, Request, usage_counts
from mirageflow.errors import RowErrorClass as E
from mirageflow.engines.http import error_kind, rejected
from mirageflow.engines.json_prefix import continuation_grammar

DEFAULT_MAX_INFLIGHT = 512  # without max_running_requests: enough to keep a GPU busy
# FINISH_MATCHED_TOKEN/FINISH_MATCHED_STR/FINISHED_MATCHED_REGEX -> "stop", FINISH_LENGTH ->
# "length", FINISH_ABORT -> "abort" (srt/managers/schedule_batch.py, to_json()["type"])
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def resolve_parallelism(server_args: ServerArgs, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(tp_size, dp_size): configured values; tp_size null -> the job's GPUs / dp_size (at least 1)."""
    dp = server_args.dp_size or 1
    tp = server_args.tp_size
    if tp is None:
        gpus = stats.allocated_gpus(environ)
        tp = max(1, gpus // dp) if gpus else 1
    return int(tp), int(dp)


def default_max_inflight(server_args: ServerArgs) -> int:
    running = server_args.extra_engine_args.get("max_running_requests")
    return 2 * int(running) if running else DEFAULT_MAX_INFLIGHT


def engine_kwargs(server_args: ServerArgs, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` (= ``ServerArgs`` fields): server_args,
    resolved parallelism, extra args verbatim (they win on a clash)."""
    tp, dp = resolve_parallelism(server_args, environ)
    kwargs = {k: v for k, v in server_args.engine_args().items() if v is not None}
    kwargs.update(tp_size=tp, dp_size=dp)
    kwargs.update(server_args.extra_engine_args)
    return kwargs


def sampling_params(request: Request) -> dict:
    params = dict(request.sampling_params)
    if request.seed is not None:  # applied by SGLang's sampler with enable_deterministic_inference
        params["sampling_seed"] = request.seed
    if request.json_schema is not None and request.response_prefix:
        # the prompt ends with the prefix; a json_schema grammar would restart the JSON after
        # it, so SGLang gets the grammar of the continuation (ValueError: no valid JSON
        # starts with the prefix)
        params["ebnf"] = continuation_grammar(request.json_schema, request.response_prefix)
    elif request.json_schema is not None:
        params["json_schema"] = request.json_schema  # SGLang wants the schema as a JSON string
    return params


def completion_from_output(rid: int, out: Mapping) -> Completion:
    """A Completion from SGLang's ``{"text", "meta_info"}`` (offline engine and /generate alike).

    An abort (``{"type": "abort", "message", "status_code", "err_type"}``) is a row error
    classed by its message: context_length, grammar_error, else aborted.
    """
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    finish = _FINISH.get(kind, "stop") if kind is not None else "stop"
    try:
        tokens = usage_counts(meta, "prompt_tokens", "completion_tokens", "meta_info")
    except BadAnswer as e:  # this request's row fails, the shard goes on
        return Completion(rid, "", 0, 0, "abort", E.BAD_ANSWER, f"SGLang answered {e}")
    completion = Completion(rid, out.get("text") or "", *tokens, finish)
    if finish == "abort":
        message = str(reason.get("message") or "") if isinstance(reason, Mapping) else ""
        completion.error_kind = error_kind(message, E.ABORTED)
        completion.error = "the engine aborted the request" + (f": {message}" if message else "")
    return completion


def request_error(rid: int, error: Exception) -> Completion | None:
    """The row error for an exception out of ``Engine.async_generate``, or None when it is
    not about this request (the caller re-raises: the shard fails).

    SGLang raises (srt/managers/tokenizer_manager.py): ValueError for request validation,
    a too-long input and scheduler aborts with status 400; ``fastapi.HTTPException``
    (``status_code``, ``detail``) for scheduler aborts with another status, e.g. 500 for
    "Grammar accept_token failed". Matched by attributes: fastapi is never imported here.
    """
    if isinstance(error, ValueError):
        return rejected(rid, str(error))
    status, detail = getattr(error, "status_code", None), getattr(error, "detail", None)
    if isinstance(status, int) and detail is not None:
        return rejected(rid, f"SGLang aborted the request (status {status}): {detail}", E.ABORTED)
    return None


def image_inputs(request: Request, prompt_ids, image_token: str | None) -> tuple[str, list[str], int | None] | Completion:
    """For a request with images: (text prompt, image_data, its text tokens), or a row error.

    SGLang gets the rendered prompt as text, holding the model's placeholder once per image
    where the chat template put it (inside the user turn), and ``image_data`` as data URIs
    in the same order; its multimodal processor expands each placeholder into the image's
    tokens. That processor tokenizes the text with the BOS added, so a leading BOS is cut
    from the text (one BOS, as with ``input_ids``). The text tokens (placeholders not
    counted) let ``image_tokens`` be told from SGLang's ``prompt_tokens``.
    """
    from mirageflow.prompts.images import placeholder_error

    problem = placeholder_error(request.prompt, image_token, len(request.images))
    if problem:
        return rejected(request.id, problem, E.IMAGE_PLACEHOLDERS)
    text, text_tokens = request.prompt, None
    if prompt_ids is not None:
        bos = prompt_ids.tokenizer.bos_token if prompt_ids.bos is not None else None
        while bos and text.startswith(bos):
            text = text[len(bos) :]
        text_tokens = len(prompt_ids(text)) - (text.count(image_token) if image_token else 0)
    return text, [image.data_uri() for image in request.images], text_tokens


def with_image_tokens(completion: Completion, text_tokens: int | None) -> Completion:
    """Set ``image_tokens``: SGLang's prompt tokens beyond the prompt's text tokens."""
    if text_tokens is not None and completion.prompt_tokens:
        completion.image_tokens = max(0, completion.prompt_tokens - text_tokens)
    return completion
