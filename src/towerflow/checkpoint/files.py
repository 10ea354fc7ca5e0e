"""Bounded reads from a checkpoint directory: regular files only, JSON of bounded depth.

Everything a checkpoint reader takes from disk passes through here, so that
no damaged or planted entry can make it hang, exhaust memory or crash:

* a directory is opened once (:func:`open_dir`) and every file in it is
  opened relative to that handle with ``O_NOFOLLOW`` (a symbolic link is
  refused, so nothing outside the directory is read) and ``O_NONBLOCK`` (a
  FIFO cannot block the open);
* the opened file must be a regular file (``fstat``; a FIFO, a device, a
  socket or a directory is refused) and its size within a limit the caller
  states, checked before a byte is read;
* JSON is decoded only after a non-recursive scan has shown that it nests no
  deeper than :data:`MAX_JSON_DEPTH`, and without ``NaN``/``Infinity``.

Every refusal is a :class:`~towerflow.errors.CheckpointError` naming the
file and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from towerflow.errors import CheckpointError, InvalidArgumentError, NotFoundError

__all__ = ["MAX_JSON_DEPTH", "json_depth_exceeds", "loads_bounded", "open_dir", "open_regular",
           "read_regular", "check_directory"]

#: The deepest nesting of arrays and objects a checkpoint's JSON may have.
MAX_JSON_DEPTH = 64

_RESTORE = "restore an earlier checkpoint"
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = ord("["), ord("{")
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_directory(path: str | Path, what: str) -> None:
    """Raise when ``path`` (or the first of its parents that exists) is not a directory, so
    that making it fails with one sentence instead of ``FileExistsError``.

    Raises:
        InvalidArgumentError: naming ``what`` (e.g. ``"the train directory"``) and the path.
    """
    probe = Path(path)
    while True:
        try:
            mode = os.stat(probe).st_mode
        except (FileNotFoundError, NotADirectoryError):  # under a file: its parent says
            if probe.parent == probe:
                return
            probe = probe.parent
            continue
        if stat.S_ISDIR(mode):
            return
        where = "" if probe == Path(path) else f" ({str(probe)!r})"
        raise InvalidArgumentError(
            f"{what.capitalize()} {str(path)!r} cannot be made: "
            f"{'it' if not where else 'a parent'} is "
            f"{'a file' if stat.S_ISREG(mode) else _kind(mode)}{where}. Name a directory (it is "
            "created when missing), or move that file away.")


@contextlib.contextmanager
def open_dir(path: str | Path, *, follow_symlinks: bool = True) -> Iterator[int]:
    """Open the directory ``path`` for reading the files in it; yield its descriptor.

    Args:
        path: The directory.
        follow_symlinks: Whether ``path`` itself may be a symbolic link. With
            False a link is a :class:`CheckpointError` (checkpoints inside a
            train dir must be real directories in it).

    Raises:
        NotFoundError: ``path`` does not exist or is not a directory.
        CheckpointError: ``path`` is a symbolic link and ``follow_symlinks`` is False.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_symlinks and os.path.islink(path):
            raise CheckpointError(
                f"Checkpoint {str(path)!r} is a symbolic link; a checkpoint must be a real "
                f"directory inside its train dir, {_RESTORE}."
            ) from exc
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
            raise NotFoundError(
                f"No checkpoint found at {str(path)!r}: it is not a directory; check the path "
                "or the train dir."
            ) from exc
        raise CheckpointError(
            f"Checkpoint {str(path)!r} cannot be opened ({exc.strerror}); {_RESTORE}."
        ) from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _checked_size(info: os.stat_result, fpath: str, max_bytes: int, exact: int | None,
                  what: str) -> int:
    """The size of an opened file, refused unless it is a regular file of an accepted size."""
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            f"Checkpoint file {fpath!r} is {_kind(info.st_mode)}, not a regular file; {_RESTORE}."
        )
    if exact is not None and info.st_size != exact:
        raise CheckpointError(
            f"Checkpoint file {fpath!r} has {info.st_size} bytes, the manifest says {exact}: it "
            f"is truncated or corrupt; {_RESTORE}."
        )
    if info.st_size > max_bytes:
        raise CheckpointError(
            f"Checkpoint file {fpath!r} is {info.st_size} bytes, more than the {max_bytes} a "
            f"{what} may have; it is damaged, {_RESTORE}."
        )
    return info.st_size


def _open_in(dir_fd: int, name: str, flags: int, fpath: str) -> int | None:
    """``os.open`` relative to ``dir_fd``; None when no entry ``name`` exists."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"Checkpoint file {fpath!r} is a symbolic link; a checkpoint reads only regular "
                f"files inside its own directory, {_RESTORE}."
            ) from exc
        raise CheckpointError(f"Checkpoint file {fpath!r} cannot be opened ({exc.strerror}); "
                              f"{_RESTORE}.") from exc


@contextlib.contextmanager
def open_regular(dir_fd: int, dir_path: str | Path, name: str, *, max_bytes: int,
                 exact: int | None = None,
                 what: str = "file") -> Iterator[tuple[BinaryIO, int] | None]:
    """Open the regular file ``name`` of an opened directory; yield it and its size.

    The checks of :func:`read_regular`, for a caller that reads the file in
    pieces (a data file hashed block by block). An ``OSError`` while the file
    is read in the body is a :class:`CheckpointError`.

    Yields:
        ``(file, size)``, or None when no entry ``name`` exists.

    Raises:
        CheckpointError: the entry is a symbolic link, not a regular file,
            larger than ``max_bytes``, not ``exact`` bytes, or unreadable.
    """
    fpath = str(Path(dir_path) / name)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = _open_in(dir_fd, name, flags, fpath)
    if fd is None:
        yield None
        return
    try:
        size = _checked_size(os.fstat(fd), fpath, max_bytes, exact, what)
        with os.fdopen(fd, "rb", closefd=False) as f:
            yield f, size
    except OSError as exc:
        raise CheckpointError(f"Checkpoint file {fpath!r} cannot be read ({exc.strerror}); "
                              f"{_RESTORE}.") from exc
    finally:
        os.close(fd)


def read_regular(dir_fd: int, dir_path: str | Path, name: str, *, max_bytes: int,
                 exact: int | None = None, what: str = "file") -> bytes | None:
    """Read the regular file ``name`` of an opened directory, within a size limit.

    Args:
        dir_fd: From :func:`open_dir`.
        dir_path: The directory's path, for messages.
        name: A plain file name (no ``/``).
        max_bytes: The largest size accepted; checked before reading.
        exact: The size the file must have, if known.
        what: What the file is, for the size message (``"manifest"``).

    Returns:
        The whole content, or None when no entry ``name`` exists.

    Raises:
        CheckpointError: the entry is a symbolic link, not a regular file,
            larger than ``max_bytes``, not ``exact`` bytes, or unreadable.
    """
    with open_regular(dir_fd, dir_path, name, max_bytes=max_bytes, exact=exact,
                      what=what) as opened:
        if opened is None:
            return None
        f, size = opened
        data = f.read(size)
    if len(data) != size:
        raise CheckpointError(f"Checkpoint file {str(Path(dir_path) / name)!r} changed size "
                              "while it was read; read it again once no other process writes it.")
    return data


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Return whether the JSON text ``data`` nests arrays/objects deeper than ``limit``.

    A scan without recursion: string literals are removed, then the brackets
    left are counted. Text that is not JSON may be over-counted (it is
    refused either way).

    Example:
        >>> json_depth_exceeds(b'{"a": [[1]], "b": "[[[["}', 3), json_depth_exceeds(b"[[[[]]]]", 3)
        (False, True)
    """
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    depth = 0
    for c in brackets:
        if c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_bounded(data: bytes, fpath: str | Path, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode UTF-8 JSON from a checkpoint file, refusing deep nesting and non-finite numbers.

    Raises:
        CheckpointError: naming ``fpath`` and what is wrong.
    """
    if json_depth_exceeds(data, max_depth):
        raise CheckpointError(
            f"Checkpoint file {str(fpath)!r} is nested deeper than {max_depth} levels; it is "
            f"damaged or not written by towerflow, {_RESTORE}."
        )
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant,
                          parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"Checkpoint file {str(fpath)!r} is not valid JSON ({exc}); the file is corrupt, "
            f"{_RESTORE}."
        ) from exc
