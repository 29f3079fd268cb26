"""The request cache: every answered request of a shard, kept across edits of the config.

An edit of a prompt, the record template, one dataset row or a later output changes the
shard's fingerprint, so its committed parts are discarded (shard/checkpoint.py). Most
requests the rerun sends are byte-identical to ones already answered: this cache keeps
each accepted answer under a key that is a hash of exactly what determines it, so the
rerun sends only requests whose key is new and rebuilds everything else (later steps,
records) from the answers kept.

The key (``request_key``) hashes:

- the engine identity (``engine_identity``): the output's processor as configured (backend,
  model, server args, chat template settings; not how it is reached: base_url, timeouts),
  the backend that actually runs (``auto`` resolved) and the model's revision
  (``model_revision``: the model directory's config, tokenizer and generation files, and
  each weight file's size and three 1 MiB samples; a hub id's cached snapshot commit);
- the request as the engine receives it: the rendered prompt (which, with the model's
  tokenizer in the identity, fixes the token ids), or the chat messages for an engine that
  templates server-side, the response prefix, the images (their canonical bytes' SHA-256);
- the sampling parameters, the request's seed, the JSON schema (grammar / response_format);
- for a request with native ``n``: n and the choice's index.

The request id (the row's index) is not part of it: a row that moved keeps its answers.

What is cached: answers the step accepted (a value was assigned). A row error from the
engine (``context_length``, an aborted request), or an answer that failed its row
(``empty_output``, invalid JSON, ``reasoning_truncated``) is not kept, so a retry asks
again. Requests that sample without a seed (``temperature`` not 0 and no
``sampling_params.seed``) are neither looked up nor kept: their answer is a draw, and
reusing it would silently make a rerun differ from a fresh run in kind.

On disk, per shard, in ``<state_dir>/shard_<id>/request_cache/``: segment files
``seg-<n>.jsonl`` (one line per answer: ``[key, text, reasoning, prompt_tokens,
completion_tokens, finish_reason, image_tokens]``) written with the checkpoint's commits
(temp name, fsync, rename), and ``manifest.json`` listing each segment with its size,
SHA-256 and number of entries. It is verified like the parts: a segment that is missing
or whose size or checksum differ is moved to ``request_cache/damaged/<UTC stamp>/`` (its
answers are asked again); a segment no manifest lists (a kill between the segment and the
manifest) to ``request_cache/orphaned/<UTC stamp>/``; an unreadable manifest is renamed
``manifest.json.damaged-<UTC stamp>`` and the cache starts empty. It is never discarded
for a fingerprint change: keys, not the config, say what an answer is for. The shard's
lease guards it like the rest of the shard's state; shards never share a cache.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

import orjson

from mirageflow.engines.wire import Completion, Request
from mirageflow.errors import MirageflowError
from mirageflow.files import atomic_write_text, new_temp_file

log = logging.getLogger(__name__)

# Part of every key and of the manifest: bumping it makes every kept answer unreachable.
CACHE_VERSION = 1
CACHE_DIR = "request_cache"
MANIFEST = "manifest.json"
SAMPLE_BYTES = 1 << 20  # of each weight file, at its start, middle and end (model_revision)
# Files of a model directory that change what it answers, hashed whole when present.
MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "preprocessor_config.json",
)  # fmt: skip
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SEGMENT = re.compile(r"seg-(\d+)\.jsonl")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _canonical(obj) -> bytes:
    """The bytes a key hashes: sorted-key compact JSON. orjson (~10x faster than json: this
    runs once per request on the row path); text orjson refuses (a lone surrogate) takes
    json's spelling, the same every time for the same request."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS, default=str)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- identity


def model_revision(model_path: str) -> str | None:
    """What identifies the weights at ``model_path`` without reading them whole.

    A directory: the SHA-256 of its config/tokenizer/generation files and, per weight file
    (``*.safetensors``, ``*.bin``, ...), its name, size and three 1 MiB samples (start,
    middle, end): a different checkpoint of the same shape differs there. A hub id: the
    commit its local Hugging Face cache resolves ``main`` to, when cached. None: nothing
    local to look at (a remote server's model: its name is the identity).
    """
    root = Path(model_path)
    if root.is_dir():
        h = hashlib.sha256()
        for name in MODEL_FILES:
            p = root / name
            if p.is_file():
                h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
                size = p.stat().st_size
                h.update(str(p.relative_to(root)).encode() + b"\0" + str(size).encode())
                with open(p, "rb") as f:
                    for at in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                        f.seek(at)
                        h.update(f.read(SAMPLE_BYTES))
        return h.hexdigest()
    if "/" in model_path and not model_path.startswith((".", "/")):
        hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
        ref = hub / ("models--" + model_path.replace("/", "--")) / "refs" / "main"
        try:
            return "hub:" + ref.read_text().strip()
        except OSError:
            return None
    return None


def engine_identity(processor: dict, backend: str, revision: str | None) -> str:
    """The digest of what, besides the request, determines an answer (the module's doc)."""
    return _sha256(_canonical({"version": CACHE_VERSION, "processor": processor, "backend": backend, "revision": revision}))


def deterministic(request: Request) -> bool:
    """Whether the request's answer is reproducible: greedy (temperature 0) or seeded."""
    if request.seed is not None:
        return True
    temperature = request.sampling_params.get("temperature")
    return temperature is not None and not isinstance(temperature, bool) and float(temperature) == 0.0


def request_key(identity: str, request: Request, choice: tuple[int, int] | None = None) -> str:
    """The key of ``request``'s answer (of choice ``(k, n)`` of a request with native n)."""
    material = {
        "engine": identity,
        "prompt": request.prompt,
        "messages": request.messages if request.prompt is None else None,
        "prefix": request.response_prefix,
        "sampling": request.sampling_params,
        "seed": request.seed,
        "schema": request.json_schema,
        "images": [image_digest(i) for i in request.images] if request.images else None,
        "choice": choice,
    }
    return _sha256(_canonical(material))


_SORTED = orjson.OPT_SORT_KEYS


def _member(name: str, value) -> bytes:
    """``value`` as ``_canonical`` spells it as the member ``name`` of the key material: dumped
    inside a one-member object, so orjson's nesting limit (255) counts the same levels."""
    return orjson.dumps({name: value}, option=_SORTED, default=str)[len(name) + 4 : -1]


class RequestKeys:
    """``request_key`` and ``sample_keys`` for the requests of one step, without building and
    sorting the key material per request. The material's canonical bytes are hashed member
    by member in ``_canonical``'s (sorted) order, and what is fixed for the step is done once:
    the engine identity, the sampling parameters, the JSON schema and the response prefix are
    serialized, and the hash of the bytes before the prompt (or the messages) of a request
    without a choice or images is kept, to be copied. The bytes hashed, and so the keys, are
    ``request_key``'s (tests/test_request_cache.py pins them); a request whose fixed parts are
    not the step's, or that orjson refuses (a lone surrogate, an integer past 64 bits), takes
    ``request_key`` itself.

    ``sampling`` is the step's dict (``LLMStep.sampling``), which every request of the
    step carries and nothing changes once the step is built: it is recognized by identity.
    """

    def __init__(self, identity: str, sampling: dict, schema: str | None, prefix: str):
        self.identity, self.sampling, self.schema, self.prefix = identity, sampling, schema, prefix
        self._at_prompt = None  # None: request_key per request
        try:
            self._engine = b',"engine":' + orjson.dumps(identity) + b',"images":'
            self._prefix = b',"prefix":' + orjson.dumps(prefix) + b',"prompt":'
            self._tail = b',"sampling":' + _member("sampling", sampling) + b',"schema":' + orjson.dumps(schema) + b',"seed":'
        except (orjson.JSONEncodeError, TypeError):
            pass
        else:
            self._tail_no_seed = self._tail + b"null}"
            # the hash of the bytes before the messages, and before the prompt, of a request without a choice or images
            self._at_messages = hashlib.sha256(b'{"choice":null' + self._engine + b'null,"messages":')
            self._at_prompt = self._at_messages.copy()
            self._at_prompt.update(b"null" + self._prefix)
        try:  # deterministic() of the step's requests without a seed
            self._greedy: bool | None = deterministic(Request(0, None, "", sampling))
        except (TypeError, ValueError):  # a temperature float() refuses: deterministic() per request (that row's error)
            self._greedy = None

    def deterministic(self, request: Request) -> bool:
        """``deterministic(request)``."""
        if request.seed is not None:
            return True
        return self._greedy if request.sampling_params is self.sampling and self._greedy is not None else deterministic(request)

    def key(self, request: Request, choice: tuple[int, int] | None = None, seed: int | None = None) -> str:
        """``request_key(identity, request, choice)``; ``seed``: of the request with this seed instead."""
        if seed is None:
            seed = request.seed
        if (
            self._at_prompt is not None and request.sampling_params is self.sampling
            and request.json_schema == self.schema and request.response_prefix == self.prefix
        ):  # fmt: skip
            images, prompt = request.images, request.prompt
            try:
                if choice is None and not images:
                    h = (self._at_messages if prompt is None else self._at_prompt).copy()
                else:
                    h = hashlib.sha256(
                        b'{"choice":' + orjson.dumps(choice) + self._engine
                        + (orjson.dumps([image_digest(i) for i in images]) if images else b"null") + b',"messages":'
                    )  # fmt: skip
                    if prompt is not None:
                        h.update(b"null" + self._prefix)
                if prompt is None:
                    h.update(_member("messages", request.messages) + self._prefix + b"null")
                else:
                    h.update(orjson.dumps(prompt))
                h.update(self._tail_no_seed if seed is None else self._tail + orjson.dumps(seed) + b"}")
                return h.hexdigest()
            except (orjson.JSONEncodeError, TypeError):
                pass
        if seed != request.seed:
            request = dataclasses.replace(request, seed=seed)
        return request_key(self.identity, request, choice)

    def sample_keys(self, request: Request, n: int, native: bool) -> list[str]:
        """``sample_keys(identity, request, n, native)``."""
        if n == 1:
            return [self.key(request)]
        if native:
            return [self.key(request, (k, n)) for k in range(n)]
        if request.seed is None:
            return [self.key(request)] * n
        return [self.key(request, None, request.seed + k) for k in range(n)]


def image_digest(image) -> str:
    """The SHA-256 of an image input's canonical bytes (prompts/images.CanonicalImage.sha256)."""
    return image.sha256


def sample_keys(identity: str, request: Request, n: int, native: bool) -> list[str]:
    """The keys of the n samples ``generate_samples(request, n)`` asks for: choice k of one
    request with n (native), or the request with seed + k (one request per sample)."""
    if n == 1:
        return [request_key(identity, request)]
    if native:
        return [request_key(identity, request, (k, n)) for k in range(n)]
    return [
        request_key(identity, Request(request.id + k, request.messages, request.prompt, request.sampling_params, request.json_schema,
                                      request.response_prefix, None if request.seed is None else request.seed + k, request.images))
        for k in range(n)
    ]  # fmt: skip


# --------------------------------------------------------------------------- the cache


def _segment(pending: list[tuple[str, tuple]]) -> bytearray:
    """A segment's bytes: a line ``[key, *answer]`` per kept answer, serialized here (the writer
    thread) rather than per put, into one buffer (orjson's bytes, kept one per answer until a
    join, cost more than the serializing)."""
    data = bytearray()
    dumps, newline = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    for key, answer in pending:
        value = (key, *answer)
        try:
            data += dumps(value, option=newline)
        except (orjson.JSONEncodeError, TypeError):  # a lone surrogate: json's spelling, the bytes as they are
            data += json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
    return data


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


class CacheDamaged(MirageflowError, ValueError):
    """A cache segment that cannot be read back as written (it is set aside, never trusted)."""


class RequestCache:
    """One shard's answers by key. ``restore()`` once under the shard's lease, then ``get``
    and ``put`` on the event loop and ``commit()`` from the writer thread."""

    def __init__(self, shard_dir: Path, lookups: bool = True):
        """``lookups`` False (``fresh_answers``): every request is sent; answers are still kept,
        replacing the ones kept before."""
        self.dir = Path(shard_dir) / CACHE_DIR
        self.manifest = self.dir / MANIFEST
        self.lookups = lookups
        self._answers: dict[str, tuple] = {}
        # the keys of the answers kept since the last commit: put() appends on the event loop (a
        # deque's append and popleft are atomic), commit() takes them in the writer thread and
        # writes each key's answer in _answers (a key put twice: its latest answer, twice). Keys
        # alone, not (key, answer) pairs: a str is no work for the cyclic GC, a pair per row was
        self._pending: collections.deque[str] = collections.deque()
        self._lock = threading.Lock()  # one commit at a time
        self.segments: list[dict] = []
        self.next_segment = 0
        self.hits = self.stored = 0
        self._stamp: str | None = None

    def __len__(self) -> int:
        return len(self._answers)

    # ------------------------------------------------------------------ lookups

    def get(self, key: str, request_id: int) -> Completion | None:
        if not self.lookups:
            return None
        found = self._answers.get(key)
        if found is None:
            return None
        self.hits += 1
        text, reasoning, prompt_tokens, completion_tokens, finish, image_tokens = found
        return Completion(request_id, text, prompt_tokens, completion_tokens, finish, reasoning=reasoning, image_tokens=image_tokens)

    def put(self, key: str, c: Completion) -> None:
        """Keep an accepted answer (written with the next commit)."""
        self._answers[key] = (c.text, c.reasoning, c.prompt_tokens, c.completion_tokens, c.finish_reason, c.image_tokens)
        self._pending.append(key)
        self.stored += 1

    # ------------------------------------------------------------------ disk

    def restore(self) -> None:
        """Load the verified segments (the module's doc: damaged and unlisted ones set aside)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stamp = None
        for tmp in self.dir.glob(".*.tmp"):  # writes a kill interrupted; the lease says no one else writes here
            tmp.unlink(missing_ok=True)
        listed = self._load_manifest()
        self.segments, self._answers, self.next_segment = [], {}, 0
        for seg in listed:
            path = self.dir / seg["name"]
            try:
                lines = self._verified(path, seg)
            except CacheDamaged as e:
                self._aside("damaged", path, str(e), seg["entries"])
                continue
            except FileNotFoundError:
                log.warning("request cache segment %s is missing: its %d answer(s) will be asked again", path, seg["entries"])
                continue
            for key, *answer in lines:
                self._answers[key] = tuple(answer)
            self._add_segment(seg)
        names = {s["name"] for s in self.segments} | {s["name"] for s in listed}
        for path in sorted(self.dir.glob("seg-*.jsonl")):
            if path.name not in names:
                self._aside("orphaned", path, f"not listed in {self.manifest.name}", None)
        self._write_manifest()
        if self._answers:
            log.info(
                "request cache of %s: %d answer(s) kept in %d segment(s)", self.dir.parent.name, len(self._answers), len(self.segments)
            )

    def _verified(self, path: Path, seg: dict) -> list[list]:
        """The segment's entries, when its size, checksum and count are the manifest's."""
        data = path.read_bytes()
        if len(data) != seg["bytes"]:
            raise CacheDamaged(f"{len(data)} bytes, {MANIFEST} says {seg['bytes']}")
        digest = _sha256(data)
        if digest != seg["sha256"]:
            raise CacheDamaged(f"sha256 {digest[:12]}..., {MANIFEST} says {seg['sha256'][:12]}...")
        try:
            # split at the newlines written, not splitlines(): an answer holds U+2028 or U+0085 as it is
            entries = [json.loads(line) for line in data.decode("utf-8", "surrogatepass").split("\n")[:-1]]
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CacheDamaged(f"unreadable: {e}") from None
        if len(entries) != seg["entries"] or not all(_good_entry(e) for e in entries):
            raise CacheDamaged(f"{len(entries)} entries, {MANIFEST} says {seg['entries']}, or not all of them answers")
        return entries

    def _load_manifest(self) -> list[dict]:
        try:
            raw = self.manifest.read_bytes()
        except FileNotFoundError:
            return []
        try:
            saved = json.loads(raw.decode("utf-8"))
            problem = _manifest_problem(saved)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not JSON: {e}"
        if problem is None:
            return saved["segments"]
        aside = self.manifest.with_name(f"{MANIFEST}.damaged-{_utc_stamp()}")
        n = 0
        while aside.exists():
            n += 1
            aside = self.manifest.with_name(f"{MANIFEST}.damaged-{_utc_stamp()}-{n}")
        os.replace(self.manifest, aside)
        log.warning(
            "%s is damaged (%s): renamed to %s; its segments are set aside and their answers asked again", self.manifest, problem, aside
        )
        return []

    def _aside(self, kind: str, path: Path, why: str, entries: int | None) -> None:
        if self._stamp is None:
            base, n = _utc_stamp(), 0
            self._stamp = base
            while (self.dir / "damaged" / self._stamp).exists() or (self.dir / "orphaned" / self._stamp).exists():
                n += 1
                self._stamp = f"{base}-{n}"
        dest = self.dir / kind / self._stamp
        dest.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(dest / path.name))
        what = f"{entries} answer(s)" if entries is not None else "answers"
        log.warning("request cache segment %s (%s): moved to %s; its %s will be asked again", path, why, dest, what)

    def _add_segment(self, seg: dict) -> None:
        self.segments.append({"name": seg["name"], "bytes": seg["bytes"], "sha256": seg["sha256"], "entries": seg["entries"]})
        m = _SEGMENT.fullmatch(seg["name"])
        if m:
            self.next_segment = max(self.next_segment, int(m.group(1)) + 1)

    def commit(self) -> None:
        """Make the answers kept since the last commit durable: a new segment, then the manifest."""
        with self._lock:
            pending = self._pending
            keys = [pending.popleft() for _ in range(len(pending))]
            if keys:
                self._write_segment(keys)

    def _write_segment(self, keys: list[str]) -> None:
        name = f"seg-{self.next_segment:05d}.jsonl"
        path = self.dir / name
        try:
            answers = self._answers
            data = _segment([(key, answers[key]) for key in keys])
            fd, tmp = new_temp_file(path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
            self._add_segment({"name": name, "bytes": len(data), "sha256": _sha256(data), "entries": len(keys)})
            self._write_manifest()
        except BaseException:  # kept for the next commit, before any put since
            self._pending.extendleft(reversed(keys))
            raise

    def _write_manifest(self) -> None:
        text = json.dumps({"format": CACHE_VERSION, "segments": self.segments}, separators=(",", ":")) + "\n"
        atomic_write_text(self.manifest, text)

    def disk_bytes(self) -> int:
        return sum(s["bytes"] for s in self.segments)


def _good_entry(e) -> bool:
    return (
        isinstance(e, list) and len(e) == 7 and isinstance(e[0], str) and isinstance(e[1], str)
        and isinstance(e[3], int) and isinstance(e[4], int) and isinstance(e[5], str)
    )  # fmt: skip


def _manifest_problem(saved) -> str | None:
    if not isinstance(saved, dict):
        return f"a JSON {type(saved).__name__}, not an object"
    if saved.get("format") != CACHE_VERSION:
        return f"format {saved.get('format')!r}, this mirageflow reads {CACHE_VERSION}"
    segments = saved.get("segments")
    if not isinstance(segments, list):
        return "no 'segments' list"
    for s in segments:
        if not (
            isinstance(s, dict) and isinstance(s.get("name"), str) and _SEGMENT.fullmatch(s["name"])
            and isinstance(s.get("bytes"), int) and s["bytes"] >= 0
            and isinstance(s.get("sha256"), str) and _SHA256.fullmatch(s["sha256"])
            and isinstance(s.get("entries"), int) and s["entries"] >= 0
        ):  # fmt: skip
            return f"bad segment entry {str(s)[:200]}"
    return None
