"""A local run's address book in its train dir, for ``towerflow status --train-dir``.

``towerflow launch --train-dir D`` and ``towerflow train --ps`` start a
cluster on random free ports with a secret made for the run. While it runs,
they keep in ``D``:

- ``cluster.json``: the cluster's address book (every task's ``host:port``;
  no secret), left after the run as its record;
- ``cluster.secret``: the run's secret, mode 0600, created when the run starts
  and removed when it ends.

:func:`read_address_book` gives both back to ``towerflow status``.

Example:
    >>> import tempfile
    >>> from towerflow.cluster import ClusterSpec
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with published(d, ClusterSpec({"ps": ["localhost:2222"]}), b"s3cret"):
    ...         cluster, secret = read_address_book(d)
    ...     cluster.as_dict(), secret
    ({'ps': ['localhost:2222']}, b's3cret')
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from towerflow.cluster.spec import ClusterSpec
from towerflow.cluster.transport import read_secret_file
from towerflow.errors import NotFoundError

__all__ = ["ADDRESS_BOOK", "SECRET_FILE", "published", "read_address_book"]

#: the cluster's addresses, in the train dir
ADDRESS_BOOK = "cluster.json"
#: the run's secret (0600), in the train dir while the run lasts
SECRET_FILE = "cluster.secret"


def _write_secret(path: Path, secret: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a run killed before it could remove its own
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secret)


@contextlib.contextmanager
def published(train_dir: str | Path, cluster: ClusterSpec, secret: bytes | None) -> Iterator[Path]:
    """Within the block, ``train_dir`` holds the cluster's address book and its secret.

    The address book stays when the block ends; the secret file is removed.
    """
    directory = Path(train_dir)
    directory.mkdir(parents=True, exist_ok=True)
    book = directory / ADDRESS_BOOK
    partial = directory / f".{ADDRESS_BOOK}.{os.getpid()}"
    partial.write_text(json.dumps(cluster.as_dict(), indent=2) + "\n")
    os.replace(partial, book)
    secret_path = directory / SECRET_FILE
    if secret is not None:
        _write_secret(secret_path, secret)
    try:
        yield book
    finally:
        if secret is not None:
            with contextlib.suppress(FileNotFoundError):
                secret_path.unlink()


def read_address_book(train_dir: str | Path) -> tuple[ClusterSpec, bytes]:
    """The cluster and the secret of the run going on in ``train_dir``.

    Raises:
        NotFoundError: ``train_dir`` holds no address book, or no secret (the run ended).
    """
    directory = Path(train_dir)
    book = directory / ADDRESS_BOOK
    if not book.is_file():
        raise NotFoundError(
            f"{str(directory)!r} holds no {ADDRESS_BOOK}: no `towerflow launch --train-dir` or "
            "`towerflow train --ps` cluster ran there; give the run's train dir, or the "
            "cluster with --cluster.")
    if not (directory / SECRET_FILE).is_file():
        raise NotFoundError(
            f"the run in {str(directory)!r} is not running ({SECRET_FILE} is kept only while "
            "it runs); start it again, or watch another run.")
    return ClusterSpec.from_json_file(book), read_secret_file(directory / SECRET_FILE)
