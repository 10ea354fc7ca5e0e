"""Fetching a publisher's archive: a URL to a file, atomically, and its MD5.

Example:
    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = pathlib.Path(d) / "x"; _ = p.write_bytes(b"abc")
    ...     md5_of(p)
    '900150983cd24fb0d6963f7d28e17f72'
"""

from __future__ import annotations

import hashlib
import logging
import os
import urllib.request
from pathlib import Path

from towerflow.errors import UnavailableError

__all__ = ["fetch_url", "md5_of"]

logger = logging.getLogger("towerflow.data")
_CHUNK = 1 << 20


def md5_of(path: Path) -> str:
    """The hex MD5 of a file, read in chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_url(url: str, archive: Path, *, what: str, way_out: str, timeout: float = 60.0) -> None:
    """Download ``url`` to ``archive`` (through a partial file renamed when whole).

    Raises:
        UnavailableError: the download failed: ``Cannot download <what> from
            <url> (<why>); <way_out>``.
    """
    partial = archive.parent / f".{archive.name}.part-{os.getpid()}"
    logger.info("Downloading %s to %s", url, archive)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as f:
            while chunk := response.read(_CHUNK):
                f.write(chunk)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise UnavailableError(f"Cannot download {what} from {url} ({exc}); {way_out}") from exc
    os.replace(partial, archive)
