"""A stand-in of the Hugging Face Hub on 127.0.0.1, speaking the protocol huggingface_hub uses.

huggingface_hub honours ``HF_ENDPOINT``; pointed here, its real ``snapshot_download`` and
``model_info`` run unchanged. What it asks, read from huggingface_hub 2.4.0's source
(``_snapshot_download.py``, ``file_download.py``, ``hf_api.py``, ``utils/_http.py``):

- ``GET /api/models/{repo}/revision/{rev}`` (``repo_info``/``model_info``): ``{"id",
  "sha", "siblings": [{"rfilename"}], "gated", "private"}``; the commit hash it returns is
  the snapshot folder's name.
- ``GET /api/models/{repo}/tree/{commit}?recursive=True`` (``list_repo_tree``, Link-header
  paginated; one page here): ``[{"type": "file", "path", "size", "oid", "lfs": {"oid",
  "size", "pointerSize"}}]`` (``lfs`` only for large files: the sha256 is their etag).
- ``HEAD /{repo}/resolve/{rev}/{file}`` (``get_hf_file_metadata``): ``X-Repo-Commit`` (the
  commit; a response without it is refused as "not a Hub"), the etag (``X-Linked-Etag``
  for LFS files, else ``ETag``: the git blob sha1), the size (``X-Linked-Size`` on a
  redirect, else ``Content-Length``). LFS files answer 302 to ``/cdn/{repo}/{sha256}``
  on a second port (the real Hub's CDN is another host: huggingface_hub follows a HEAD's
  redirect only on the Hub's own origin, and reads the metadata off the 302), which the
  GET then fetches.
- ``GET`` of a file, with ``Range: bytes=N-`` when huggingface_hub resumes a dropped
  connection inside one process (``http_get`` retries): 206 with the rest.
- Errors as ``hf_raise_for_status`` reads them: ``X-Error-Code: RepoNotFound`` (401, as
  the Hub answers an anonymous caller), ``RevisionNotFound`` (404), ``GatedRepo`` (401 on a
  gated repo's files without a token).

Dataset repos and the upload API (``HfApi.create_repo``, ``create_branch``, ``dataset_info``,
``upload_folder``; read from huggingface_hub 2.4.0's ``hf_api.py``, ``_commit_api.py``,
``lfs.py``, ``utils/_http.py``): ``POST /api/repos/create`` (409 with the url when it
exists); ``GET /api/datasets/{repo}[/revision/{rev}]`` (``cardData``: the YAML header of
its README.md, as the Hub parses it); ``GET /api/datasets/{repo}/tree/{rev}``;
``POST /api/datasets/{repo}/branch/{name}``; ``POST /api/validate-yaml``;
``POST /api/datasets/{repo}/preupload/{rev}`` (``uploadMode`` lfs for Parquet files and
large ones, else regular; ``oid`` of the file there, so an unchanged file is not sent);
``POST /datasets/{repo}.git/info/lfs/objects/batch`` (an object the store has gets no
``actions``: it is not sent again), ``PUT /lfs/{sha256}`` (stored only when the whole body
arrived and its sha256 matches), ``POST /lfs-verify/{sha256}``; ``POST
/api/datasets/{repo}/commit/{rev}`` (ndjson: header, file, lfsFile, deletedFile,
deletedFolder). The fake speaks no Xet: a client runs with ``HF_HUB_DISABLE_XET=1``.
Writes need ``Authorization: Bearer <token>`` when ``token`` is set.

Trouble for tests: ``drop_after[file] = n`` closes the connection after ``n`` bytes of the
first GET of that file (huggingface_hub resumes with a Range request); ``bytes_per_second``
throttles file bodies (so a test can kill a download half-way). ``requests`` records
``(method, path, range header, bytes sent)`` once a request is answered; ``sending[file]``
counts the bytes of a body being sent. ``too_many[route] = n`` answers the next ``n``
requests of a write route (``preupload``, ``batch``, ``commit``, ``upload``) 429;
``upload_plan`` is consumed one entry per LFS upload, in arrival order (None: full speed,
a number: bytes per second read of its body, "hold": the body is read but never answered
nor stored, until the client goes away: an upload cut before the store confirmed it); ``refuse_writes`` answers writes 403 with a
message that repeats the caller's token (as a careless proxy would). ``lfs_puts`` lists
the sha256 of each LFS body received in full; ``commits`` each commit's operations.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fakes.fake_http import LocalHTTPServer

LFS_MIN_BYTES = 100_000  # files at least this big are served as LFS files (weights)
CHUNK = 16 * 1024


@dataclass
class HubRepo:
    files: dict[str, bytes]
    gated: bool = False
    tags: dict[str, str] = field(default_factory=dict)  # tag -> commit (besides main)

    @property
    def commit(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha1(self.files[name]).digest())
        return digest.hexdigest()

    def entry(self, name: str) -> dict:
        data = self.files[name]
        out = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
        if is_lfs(name, len(data)):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


def is_lfs(name: str, size: int) -> bool:
    """Stored in LFS, as the Hub's default .gitattributes says: Parquet files, and large files."""
    return name.endswith(".parquet") or size >= LFS_MIN_BYTES


def card_data(readme: bytes | None) -> dict | None:
    """The YAML header of a README.md, as the Hub returns it in ``cardData``."""
    text = (readme or b"").decode("utf-8", "replace")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return None
    import yaml

    return yaml.safe_load(text[4 : text.index("\n---", 3)]) or None


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def repo_from_dir(path: Path, *, config_overrides: dict | None = None, gated: bool = False) -> HubRepo:
    """A repo holding a model directory's files (config.json edited by ``config_overrides``)."""
    files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    if config_overrides:
        config = json.loads(files["config.json"])
        config.update(config_overrides)
        files["config.json"] = json.dumps(config, indent=2).encode()
    return HubRepo(files=files, gated=gated)


class FakeHub:
    def __init__(self, repos: dict[str, HubRepo], host: str = "127.0.0.1", port: int = 0):
        self.repos = repos
        self.datasets: dict[str, dict[str, HubRepo]] = {}  # repo id -> branch -> files
        self.private: set[str] = set()
        self.lfs: dict[str, bytes] = {}  # sha256 -> content (the LFS store)
        self.token: str | None = None
        self.too_many: dict[str, int] = {}
        self.upload_plan: list[float | str | None] = []
        self.refuse_writes = False
        self.lfs_puts: list[str] = []
        self.commits: list[list[dict]] = []
        self.drop_after: dict[str, int] = {}
        self.bytes_per_second: float | None = None
        self.requests: list[tuple[str, str, str | None, int]] = []
        self.sending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._hub, self._cdn = LocalHTTPServer(), LocalHTTPServer()
        self._hub.listen(host, port, _handler(self))
        self._cdn.listen(host, 0, _handler(self))  # another origin, as the Hub's CDN

    @property
    def url(self) -> str:
        return self._hub.url

    @property
    def cdn_url(self) -> str:
        return self._cdn.url

    def start(self) -> "FakeHub":
        self._hub.start()
        self._cdn.start()
        return self

    def stop(self) -> None:
        self._hub.stop()
        self._cdn.stop()

    def record(self, method: str, path: str, range_header: str | None, sent: int) -> None:
        with self._lock:
            self.requests.append((method, path, range_header, sent))

    def gets(self, name: str) -> list[tuple[str, str, str | None, int]]:
        """The GET requests of a file's body: ``name`` is its path in the repo, or an LFS file's sha256 (the CDN's)."""
        with self._lock:
            return [r for r in self.requests if r[0] == "GET" and r[1].endswith("/" + name)]

    def resolve(self, repo_id: str, rev: str) -> str | None:
        repo = self.repos[repo_id]
        if rev in ("main", repo.commit):
            return repo.commit
        return repo.tags.get(rev)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def _repo(self, repo_id: str) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found")
            return repo

        def do_HEAD(self):
            self._route()

        def do_POST(self):
            _writes(hub, self)

        def do_PUT(self):
            _writes(hub, self)

        def do_GET(self):
            self._route()

        def _route(self):
            path = unquote(urlsplit(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                return self._api(parts[2:])
            if parts[:2] == ["api", "datasets"]:
                hub.record(self.command, self.path, None, 0)
                return _dataset_api(hub, self, parts[2:])
            if parts[0] == "cdn" and len(parts) == 4:
                return self._cdn("/".join(parts[1:3]), parts[3])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            self._error(404, "EntryNotFound", f"no route {path}")

        def _api(self, rest: list[str]):
            repo_id = "/".join(rest[:2])
            repo = self._repo(repo_id)
            if repo is None:
                return
            if len(rest) == 2 or rest[2] == "revision":
                rev = rest[3] if len(rest) > 3 else "main"
                commit = hub.resolve(repo_id, rev)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return self._json(200, {
                    "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": name} for name in sorted(repo.files)],
                })  # fmt: skip
            if rest[2] == "tree":
                commit = hub.resolve(repo_id, rest[3])
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[3]}")
                return self._json(200, [repo.entry(name) for name in sorted(repo.files)])
            self._error(404, "EntryNotFound", "unknown api route")

        def _resolve(self, repo_id: str, rev: str, name: str):
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = hub.resolve(repo_id, rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            if repo.gated and not self.headers.get("Authorization"):
                return self._error(401, "GatedRepo", "Access to this model is restricted; you must be authenticated")
            if name not in repo.files:
                return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
            entry = repo.entry(name)
            if "lfs" in entry:
                sha = entry["lfs"]["oid"]
                self.send_response(302)
                self.send_header("Location", f"{hub.cdn_url}/cdn/{repo_id}/{sha}")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(entry["size"]))
                self.send_header("ETag", f'"{entry["oid"]}"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                hub.record(self.command, self.path, self.headers.get("Range"), 0)
                return
            self._body(repo.files[name], {"X-Repo-Commit": commit, "ETag": f'"{entry["oid"]}"'}, name)

        def _cdn(self, repo_id: str, sha: str):
            repo = hub.repos.get(repo_id)
            for name, data in repo.files.items() if repo else ():
                if hashlib.sha256(data).hexdigest() == sha:
                    return self._body(data, {"ETag": f'"{sha}"'}, name)
            self._json(404, {"error": "no such object"})

        def _body(self, data: bytes, headers: dict, name: str):
            start = 0
            range_header = self.headers.get("Range")
            if range_header and range_header.startswith("bytes=") and range_header.endswith("-"):
                start = int(range_header[len("bytes=") : -1])
            self.send_response(206 if start else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                hub.record("HEAD", self.path, range_header, 0)
                return
            drop = hub.drop_after.pop(name, None)  # once
            end = len(data) if drop is None else min(len(data), start + drop)
            sent = 0
            try:
                for pos in range(start, end, CHUNK):
                    chunk = data[pos : min(pos + CHUNK, end)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    hub.sending[name] = sent
                    if hub.bytes_per_second:
                        time.sleep(len(chunk) / hub.bytes_per_second)
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                hub.record("GET", self.path, range_header, sent)
            if drop is not None:
                self.close_connection = True
                try:
                    self.connection.shutdown(2)
                except OSError:
                    pass

    return Handler


# --------------------------------------------------------------------------- dataset repos and uploads


def _reply(handler, status: int, body, headers: dict | None = None) -> None:
    handler._json(status, body, headers)


def _dataset_api(hub: FakeHub, handler, rest: list[str]) -> None:
    """GET /api/datasets/{repo}[/revision/{rev}] and /api/datasets/{repo}/tree/{rev}[/{path}]."""
    repo_id = "/".join(rest[:2])
    branches = hub.datasets.get(repo_id)
    if branches is None:
        return handler._error(401, "RepoNotFound", "Repository not found")
    rev = rest[3] if len(rest) > 3 else "main"
    repo = branches.get(rev)
    if repo is None:
        return handler._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
    if len(rest) == 2 or rest[2] == "revision":
        return _reply(handler, 200, {
            "id": repo_id, "sha": repo.commit, "private": repo_id in hub.private, "gated": False, "disabled": False,
            "tags": [], "cardData": card_data(repo.files.get("README.md")),
            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
        })  # fmt: skip
    if rest[2] == "tree":
        under = "/".join(rest[4:])
        return _reply(handler, 200, [repo.entry(n) for n in sorted(repo.files) if not under or n.startswith(under + "/")])
    handler._error(404, "EntryNotFound", "unknown api route")


def _body(handler) -> bytes:
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _writes(hub: FakeHub, handler) -> None:
    path = unquote(urlsplit(handler.path).path)
    parts = path.strip("/").split("/")
    route = (
        "upload" if parts[0] == "lfs" else "verify" if parts[0] == "lfs-verify" else "batch" if path.endswith("/info/lfs/objects/batch")
        else parts[4] if parts[:2] == ["api", "datasets"] and len(parts) > 4 else "/".join(parts[:3])
    )  # fmt: skip
    if route != "upload":
        body = _body(handler)  # read before any answer: the connection is kept
    if hub.too_many.get(route):
        hub.too_many[route] -= 1
        hub.record(handler.command, handler.path, None, 0)
        if route == "upload":
            _body(handler)
        return handler._error(429, "RateLimited", "Too many requests, retry later")
    auth = handler.headers.get("Authorization") or ""
    if hub.refuse_writes:
        if route == "upload":
            _body(handler)
        hub.record(handler.command, handler.path, None, 0)
        return handler._error(403, "Forbidden", f"the token {auth.removeprefix('Bearer ')} has no write access to this repo")
    if hub.token and route != "upload" and auth != f"Bearer {hub.token}":  # the upload href is pre-signed (the Hub's S3)
        hub.record(handler.command, handler.path, None, 0)
        return handler._error(401, "Unauthorized", "Invalid credentials in Authorization header")
    if route == "upload":
        return _lfs_put(hub, handler, parts[1])
    hub.record(handler.command, handler.path, None, len(body))
    if route == "verify":
        return _reply(handler, 200, {"success": True})
    if route == "api/validate-yaml":
        return _reply(handler, 200, {"errors": [], "warnings": []})
    if route == "api/repos/create":
        return _create(hub, handler, json.loads(body))
    if route == "batch":
        return _batch(hub, handler, json.loads(body))
    repo_id, rev = "/".join(parts[2:4]), parts[5] if len(parts) > 5 else "main"
    branches = hub.datasets.get(repo_id)
    if branches is None:
        return handler._error(404, "RepoNotFound", "Repository not found")
    if route == "branch":
        if rev in branches:
            return handler._error(409, "Conflict", f"Reference {rev} already exists")
        branches[rev] = HubRepo(files=dict(branches["main"].files))
        return _reply(handler, 200, {})
    if rev not in branches:
        return handler._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
    if route == "preupload":
        return _preupload(handler, branches[rev], json.loads(body))
    if route == "commit":
        return _commit(hub, handler, repo_id, rev, branches[rev], body)
    handler._error(404, "EntryNotFound", f"no route {path}")


def _create(hub: FakeHub, handler, payload: dict) -> None:
    repo_id = f"{payload.get('organization')}/{payload['name']}" if payload.get("organization") else payload["name"]
    url = f"{hub.url}/datasets/{repo_id}"
    if repo_id in hub.datasets:
        return _reply(handler, 409, {"error": "You already created this dataset repo", "url": url}, {"X-Error-Message": "exists"})
    hub.datasets[repo_id] = {"main": HubRepo(files={".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"})}
    if payload.get("private") or payload.get("visibility") == "private":  # huggingface_hub 2.x sends visibility
        hub.private.add(repo_id)
    _reply(handler, 200, {"url": url, "name": repo_id})


def _preupload(handler, repo: HubRepo, payload: dict) -> None:
    files = []
    for f in payload["files"]:
        lfs = is_lfs(f["path"], f["size"])
        there = repo.files.get(f["path"])
        oid = None if there is None else hashlib.sha256(there).hexdigest() if lfs else git_blob_sha1(there)
        files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
    _reply(handler, 200, {"files": files, "commitOid": repo.commit})


def _batch(hub: FakeHub, handler, payload: dict) -> None:
    objects = []
    for obj in payload["objects"]:
        entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
        if obj["oid"] not in hub.lfs:  # what the store has is not sent again
            entry["actions"] = {
                "upload": {"href": f"{hub.url}/lfs/{obj['oid']}"},
                "verify": {"href": f"{hub.url}/lfs-verify/{obj['oid']}"},
            }
        objects.append(entry)
    _reply(handler, 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})


def _lfs_put(hub: FakeHub, handler, oid: str) -> None:
    plan = hub.upload_plan.pop(0) if hub.upload_plan else None
    length = int(handler.headers.get("Content-Length") or 0)
    data = bytearray()
    try:
        while len(data) < length:
            chunk = handler.rfile.read(min(CHUNK, length - len(data)))
            if not chunk:
                break
            data += chunk
            hub.sending[oid] = len(data)
            if isinstance(plan, float):
                time.sleep(len(chunk) / plan)
        if plan == "hold":  # no answer until the client has gone (it reads EOF), at most a minute
            handler.connection.settimeout(60)
            while handler.connection.recv(1):
                pass
    except (ConnectionResetError, BrokenPipeError, TimeoutError):
        pass
    hub.record("PUT", handler.path, None, len(data))
    if len(data) < length or plan == "hold":  # the client went away: nothing stored
        handler.close_connection = True
        return
    if hashlib.sha256(bytes(data)).hexdigest() != oid:
        return handler._error(400, "BadRequest", "content does not match its sha256")
    with hub._lock:
        hub.lfs[oid] = bytes(data)
        hub.lfs_puts.append(oid)
    _reply(handler, 200, {})


def _commit(hub: FakeHub, handler, repo_id: str, rev: str, repo: HubRepo, body: bytes) -> None:
    ops = [json.loads(line) for line in body.splitlines() if line.strip()]
    files = dict(repo.files)
    for op in ops:
        key, value = op["key"], op["value"]
        if key == "file":
            files[value["path"]] = base64.b64decode(value["content"])
        elif key == "lfsFile":
            if value["oid"] not in hub.lfs:
                return handler._error(422, "BadRequest", f"LFS object {value['oid']} of {value['path']} was never uploaded")
            files[value["path"]] = hub.lfs[value["oid"]]
        elif key == "deletedFile":
            files.pop(value["path"], None)
        elif key == "deletedFolder":
            files = {k: v for k, v in files.items() if not k.startswith(value["path"].rstrip("/") + "/")}
    new = HubRepo(files=files)
    hub.datasets[repo_id][rev] = new
    hub.commits.append(ops)
    _reply(
        handler, 200, {"commitUrl": f"{hub.url}/datasets/{repo_id}/commit/{new.commit}", "commitOid": new.commit, "pullRequestUrl": None}
    )
