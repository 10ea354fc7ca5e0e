"""Crash-safe file and directory writes: temporary name, fsync, rename.

A reader never sees a half-written file or directory: everything is written
under a temporary name that starts with :data:`TEMP_PREFIX` (readers ignore
such names), flushed to stable storage with ``fsync``, and only then renamed
to its final name with ``os.rename`` / ``os.replace``, which POSIX makes
atomic within a file system. The parent directory is fsynced after a rename so
that the new name itself survives a power loss.

Temporary names carry the machine and the id of the process that made them
(``.tmp-<what>-<host>-<pid>-<random>``), so that :func:`remove_stale_temps`
removes what a killed writer left behind without disturbing a live one, even
on a file system shared by several machines.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "FOREIGN_STALE_SECONDS",
    "HOST_TAG",
    "TEMP_PREFIX",
    "fsync_dir",
    "in_use",
    "is_temp_name",
    "remove_stale_temps",
    "remove_tree",
    "temp_dir",
    "temp_name",
    "write_bytes_durable",
    "write_file_atomic",
]

#: Every temporary file or directory name starts with this prefix.
TEMP_PREFIX = ".tmp-"

#: A temporary entry of another machine is stale after this many seconds untouched.
FOREIGN_STALE_SECONDS = 3600.0

_TEMP_RE = re.compile(r"^\.tmp-.*-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}$")
#: This machine's tag in temporary names (a hash of the host name).
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]

# Temporary names this process is writing right now; never stale.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def in_use(name: str) -> Iterator[str]:
    """Mark the temporary ``name`` as being written by this process.

    :func:`remove_stale_temps` leaves such names alone; every other temporary
    name carrying this process's id is a leftover (a reused pid) and removed.
    """
    with _ACTIVE_LOCK:
        _ACTIVE.add(name)
    try:
        yield name
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(name)


def temp_name(what: str) -> str:
    """Return a fresh temporary name ``.tmp-<what>-<host>-<pid>-<random>``.

    Example:
        >>> temp_name("ckpt-7").startswith(".tmp-ckpt-7-")
        True
    """
    return f"{TEMP_PREFIX}{what}-{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    """Return whether ``name`` is a temporary name (readers skip these).

    Example:
        >>> is_temp_name(".tmp-latest-12-0a1b2c3d"), is_temp_name("ckpt-00000007")
        (True, False)
    """
    return name.startswith(TEMP_PREFIX)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (new, renamed or removed names) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_bytes_durable(path: str | Path, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it (no rename).

    Used for files inside a temporary directory that is renamed as a whole.
    The file must not exist: an entry already there — a symbolic link
    planted at the name included — is a ``FileExistsError``, never written
    through.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(path, flags, 0o644), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: str | Path, data: bytes | str) -> None:
    """Replace the file at ``path`` with ``data`` atomically.

    The data goes to a temporary sibling first, is fsynced, then replaces
    ``path`` in one ``os.replace``; the directory is fsynced after. A crash
    at any moment leaves either the old content or the new one.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "latest"
        >>> write_file_atomic(p, "ckpt-00000010\\n"); p.read_text()
        'ckpt-00000010\\n'
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.parent / temp_name(path.name)
    with in_use(tmp.name):
        try:
            write_bytes_durable(tmp, payload)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def temp_dir(parent: str | Path, what: str) -> Iterator[Path]:
    """Create an empty temporary directory in ``parent``, marked in use.

    The directory is removed on exit unless the body renamed it away.
    """
    path = Path(parent) / temp_name(what)
    with in_use(path.name):
        path.mkdir()
        try:
            yield path
        finally:
            _remove_entry(path)


def _remove_entry(path: Path) -> None:
    """Delete ``path`` whatever it is; a symbolic link is unlinked, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_tree(path: str | Path) -> None:
    """Remove a directory so that no half-removed copy is ever visible.

    The directory is first renamed to a temporary name (atomic), then deleted;
    a crash in between leaves a temporary directory that
    :func:`remove_stale_temps` cleans up later. A symbolic link (or a file)
    at ``path`` is removed itself: what a link points to is never touched.
    """
    path = Path(path)
    doomed = path.parent / temp_name(f"rm-{path.name}")
    with in_use(doomed.name):
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        fsync_dir(path.parent)
        _remove_entry(doomed)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime > seconds
    except FileNotFoundError:
        return False


def remove_stale_temps(directory: str | Path) -> list[str]:
    """Remove temporary entries in ``directory`` left by dead writers.

    An entry made on this machine is stale when the process that made it (the
    pid in its name) no longer runs, or is this process and the name is not
    being written (a pid reused after a restart). Entries of other live
    processes are left alone: they may be mid-write. An entry made on another
    machine is stale once untouched for :data:`FOREIGN_STALE_SECONDS`.

    Returns:
        The names removed.
    """
    directory = Path(directory)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    me = os.getpid()
    with _ACTIVE_LOCK:
        active = set(_ACTIVE)
    for name in names:
        match = _TEMP_RE.match(name)
        if match is None or name in active:
            continue
        target = directory / name
        if match.group("host") != HOST_TAG:
            if not _older_than(target, FOREIGN_STALE_SECONDS):
                continue
        else:
            pid = int(match.group("pid"))
            if pid != me and _pid_alive(pid):
                continue
        _remove_entry(target)
        removed.append(name)
    return removed
