"""Atomic files: readers see the old content or the new one, never half.

Files and directories are created as ``open``/``mkdir`` create them (0666 / 0777 less the
umask, and any default ACL), never with ``tempfile``'s private 0600 / 0700.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path

from mirageflow.errors import MirageflowError


def new_temp_file(path: Path) -> tuple[int, Path]:
    """Open a new temp file next to ``path`` for writing: (fd, temp path). Mode 0666 less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temp file next to {path}")


def new_temp_dir(path: Path) -> Path:
    """Create a new temp directory next to ``path``. Mode 0777 less the umask."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}")
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temp directory next to {path}")


@contextlib.contextmanager
def atomic_file(path: Path, durable: bool = True):
    """A binary file to write at a temp name next to ``path``: on a clean exit it is flushed,
    fsynced (``durable``) and renamed onto ``path``; on an error it is removed, and ``path``
    keeps what it had."""
    path = Path(path)
    fd, tmp = new_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True, only_if_absent: bool = False) -> bool:
    """Write a whole file so readers see the old content or the new one, never half.

    ``durable``: fsync before the rename, so the new content also survives a crash of the
    machine (not only of the process); off for files that only mark liveness.
    ``only_if_absent``: never replace an existing file (the new one is hard-linked into
    place, which fails when another process got there first). Returns whether it wrote.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if not only_if_absent:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links on this filesystem: a rename, after a last check
            if path.exists():
                return False
            os.replace(tmp, path)
        return True
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_json(path: Path, obj, durable: bool = True, indent: int | None = 2) -> None:
    """``indent=None``: compact, and encoded by json's C encoder (several times faster)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n", durable)


# --------------------------------------------------------------------------- inputs: regular files only

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotRegularFile(MirageflowError, OSError):
    """An input path is something else than a regular file (a FIFO, a device, a directory)."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` (symbolic links followed) cannot be read as an input file, or None.

    Only ``stat``: a FIFO or a device is never opened (opening a FIFO for reading waits for
    a writer, forever)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        return f"cannot be read ({getattr(e, 'strerror', None) or e})"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {_kind(st.st_mode)}, not a regular file"


def path_hint(path: str | os.PathLike) -> str:
    """ " (did you mean '<path>'?)" for a path that does not exist when a close name is where it
    is missing (its first missing component, among its parent's entries); else ""."""
    import difflib

    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        here = Path(*parts[:i])
        if here.exists():
            continue
        parent = Path(*parts[: i - 1]) if i > 1 else Path(".")
        try:
            names = os.listdir(parent)
        except OSError:
            return ""
        close = difflib.get_close_matches(parts[i - 1], names, n=1, cutoff=0.6)
        if not close:
            return ""
        guess = Path(*parts[: i - 1], close[0], *parts[i:]) if i > 1 else Path(close[0], *parts[i:])
        return f" (did you mean '{guess}'?)"
    return ""


def open_regular(path: str | os.PathLike, mode: str = "rb"):
    """``open(path, mode)`` for reading, refusing anything but a regular file before any read.

    Opened non-blocking (a FIFO opens at once instead of waiting for a writer), checked
    with ``fstat`` (no race with a swapped path), then switched back to blocking reads.
    Raises NotRegularFile (an OSError), FileNotFoundError, PermissionError, ...
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{os.fspath(path)} is {_kind(st.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- file identity by content

DIGEST_CHARS = 16


def stat_key(st: os.stat_result) -> list[int]:
    """What identifies a file's version without reading it: inode, size, mtime, ctime (the
    kernel sets ctime on every write, rename and ``utime``, so ``cp -p`` changes it). Not the
    device: an NFS mount has another one on each node, the inode and times are the server's."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_sha256(path: str | os.PathLike) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_of(value) -> str:
    """A short digest of a JSON-able value (a stamp's name)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:DIGEST_CHARS]


class ContentCache:
    """path -> (stat identity, sha256): a file is hashed again only when its stat identity changed."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        self.changed = False
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                self.entries = {k: v for k, v in data.get("files", {}).items() if isinstance(v, list) and len(v) == 2}
            except (OSError, ValueError, AttributeError):
                self.entries = {}  # absent or damaged: rebuilt

    def recorded(self, path: str, key: list[int], known: tuple[list, str] | None = None) -> str | None:
        """The identity recorded for ``path`` at stat identity ``key`` (by ``known``, a (stat
        identity, digest) recorded elsewhere such as an index, or by this cache); None when
        neither was recorded at that stat identity. Never reads the file."""
        if known is not None and list(known[0]) == key:
            return known[1]
        cached = self.entries.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        return None

    def digest(self, path: str, known: tuple[list, str] | None = None, identify=file_sha256) -> str | None:
        """The file's content identity (None when it cannot be read): its SHA-256, or what
        ``identify(path)`` says (a Parquet file's footer identity, mirageflow.data.readers).
        ``known``: a (stat identity, digest) recorded elsewhere (an index) that spares the
        hash when it still holds."""
        try:
            key = stat_key(os.stat(path))
        except (OSError, ValueError):
            return None
        found = self.recorded(path, key, known)
        if found is not None:
            return found
        try:
            sha = identify(path)
        except (OSError, ValueError):
            return None
        self.entries[path] = [key, sha]
        self.changed = True
        return sha

    def save(self) -> None:
        if self.path is not None and self.changed:
            data = {"note": "SHA-256 of input files by stat identity (inode, size, mtime_ns, ctime_ns)", "files": self.entries}
            atomic_write_bytes(self.path, (json.dumps(data) + "\n").encode(), durable=False)
            self.changed = False
