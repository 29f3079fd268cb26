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

Trouble for tests: ``drop_after[file] = n`` closes the connection after ``n`` bytes of the
first GET of that file (huggingface_hub resumes with a Range request); ``bytes_per_second``
throttles file bodies (so a test can kill a download half-way). ``requests`` records
``(method, path, range header, bytes sent)`` once a request is answered; ``sending[file]``
counts the bytes of a body being sent.
"""

from __future__ import annotations

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
        if len(data) >= LFS_MIN_BYTES:
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


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

        def do_GET(self):
            self._route()

        def _route(self):
            path = unquote(urlsplit(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                return self._api(parts[2:])
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
