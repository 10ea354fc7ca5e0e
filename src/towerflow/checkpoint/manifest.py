"""The manifest of a checkpoint: what its files hold, sealed by a digest.

``manifest.json`` records the format, the step, the creation time, free JSON
metadata and, per data file, its entry (:mod:`towerflow.checkpoint.data_file`)::

    {"format": "towerflow.checkpoint/2", "step": 1000, "created": 1700000000.0,
     "metadata": {...},
     "files": {"model.safetensors": {"sha256": "...", "bytes": 1234,
               "tensors": {"fc.weight": {"dtype": "float32", "shape": [10, 4]}}}}}

A checkpoint with chunked groups has the format ``towerflow.checkpoint/3`` and
lists their parts under ``"chunked"`` (:mod:`towerflow.checkpoint.chunked`).

``manifest.sha256`` is one line in ``sha256sum`` form
(``<sha256 of manifest.json>  manifest.json``; ``sha256sum -c manifest.sha256``
checks it by hand). Checkpoints of the earlier format
(``towerflow.checkpoint/1``, no digest file) are still read, with a warning
that their manifest cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from towerflow.checkpoint.chunked import FORMAT_CHUNKED, chunked_problem
from towerflow.checkpoint.data_file import RESTORE, entry_problem, is_count
from towerflow.checkpoint.files import (
    MAX_JSON_DEPTH,
    json_depth_exceeds,
    loads_bounded,
    open_dir,
    read_regular,
)
from towerflow.errors import CheckpointError, InvalidArgumentError

__all__ = [
    "DIGEST_NAME",
    "FORMAT",
    "LEGACY_FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "check_step",
    "digest_line",
    "encode_manifest",
    "load_manifest",
    "read_manifest",
]

logger = logging.getLogger("towerflow.checkpoint")

FORMAT = "towerflow.checkpoint/2"
#: The format before manifests carried a digest; read with a warning.
LEGACY_FORMAT = "towerflow.checkpoint/1"
MANIFEST_NAME = "manifest.json"
DIGEST_NAME = "manifest.sha256"
#: The largest manifest read or written (metadata included).
MAX_MANIFEST_BYTES = 64 << 20

_DIGEST_LINE_RE = re.compile(rb"[0-9a-f]{64}  " + re.escape(MANIFEST_NAME.encode()) + rb"\n")
_MAX_DIGEST_BYTES = 256


def check_step(step: int) -> None:
    """Refuse a step that is not a non-negative integer."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"Checkpoint step {step!r} is not a non-negative integer.")


def digest_line(manifest_bytes: bytes) -> bytes:
    """Return the content of ``manifest.sha256`` for a manifest's bytes.

    Example:
        >>> digest_line(b"{}")[:16], digest_line(b"{}")[64:]
        (b'44136fa355b3678a', b'  manifest.json\\n')
    """
    return f"{hashlib.sha256(manifest_bytes).hexdigest()}  {MANIFEST_NAME}\n".encode()


def encode_manifest(step: int, meta: dict[str, Any], files: dict[str, Any],
                    chunked: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for a checkpoint's files and chunked groups.

    Raises:
        InvalidArgumentError: the metadata nests too deep, or makes the manifest too large.
    """
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "created": time.time(),
                                "metadata": meta, "files": files}
    if chunked:
        manifest.update(format=FORMAT_CHUNKED, chunked=chunked)
    data = json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")
    if json_depth_exceeds(data):
        raise InvalidArgumentError(
            f"Checkpoint metadata is nested deeper than the {MAX_JSON_DEPTH} levels a manifest "
            "may hold; flatten it (a checkpoint reader refuses deeper JSON)."
        )
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidArgumentError(
            f"Checkpoint manifest would be {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} "
            "a reader accepts; keep large values in tensor groups, not in the metadata."
        )
    return data


def _manifest_problem(manifest: Any) -> str | None:
    formats = (FORMAT, FORMAT_CHUNKED, LEGACY_FORMAT)
    if not isinstance(manifest, dict) or manifest.get("format") not in formats:
        return f"its format is not {FORMAT!r} or {FORMAT_CHUNKED!r}"
    if not is_count(manifest.get("step")):
        return "its step is not a non-negative integer"
    if not isinstance(manifest.get("metadata", {}), dict):
        return "its metadata is not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "it lists no files"
    problem = next((p for p in (entry_problem(k, v) for k, v in files.items()) if p), None)
    return problem or chunked_problem(manifest)


def _check_digest(path: Path, manifest: bytes, sealed: bytes) -> None:
    expected = digest_line(manifest)
    if sealed == expected:
        return
    if _DIGEST_LINE_RE.fullmatch(sealed):
        raise CheckpointError(
            f"Checkpoint manifest {str(path / MANIFEST_NAME)!r} does not match its digest in "
            f"{DIGEST_NAME} (sha256 {expected[:64].decode()}, recorded {sealed[:64].decode()}): "
            f"one of the two is damaged; {RESTORE}."
        )
    raise CheckpointError(
        f"Checkpoint digest file {str(path / DIGEST_NAME)!r} is malformed (expected one line "
        f"'<sha256>  {MANIFEST_NAME}'): it is damaged; {RESTORE}."
    )


def load_manifest(dir_fd: int, path: Path) -> dict[str, Any]:
    """Read, authenticate and validate the manifest of the opened checkpoint ``path``."""
    mpath = path / MANIFEST_NAME
    raw = read_regular(dir_fd, path, MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    if raw is None:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} has no {MANIFEST_NAME} (an incomplete save); {RESTORE}."
        )
    sealed = read_regular(dir_fd, path, DIGEST_NAME, max_bytes=_MAX_DIGEST_BYTES,
                          what="digest file")
    if sealed is not None:
        _check_digest(path, raw, sealed)
    manifest = loads_bounded(raw, mpath)
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(
            f"Checkpoint manifest {str(mpath)!r} is not a towerflow checkpoint manifest: "
            f"{problem}; {RESTORE}."
        )
    if sealed is None:
        if manifest["format"] != LEGACY_FORMAT:
            raise CheckpointError(
                f"Checkpoint {str(path)!r} has no {DIGEST_NAME}, so its manifest cannot be "
                f"verified (the file was lost or removed); {RESTORE}."
            )
        logger.warning(
            "Checkpoint %s predates manifest digests (format %r): its files are verified but "
            "its step and metadata cannot be; save it again to add a digest.",
            path, LEGACY_FORMAT,
        )
    return manifest


def read_manifest(path: str | Path, *, follow_symlinks: bool = True) -> dict[str, Any]:
    """Read, authenticate and validate the manifest of the checkpoint directory ``path``.

    Args:
        path: A checkpoint directory.
        follow_symlinks: Whether ``path`` itself may be a symbolic link.

    Raises:
        NotFoundError: ``path`` is not a directory.
        CheckpointError: the manifest is missing, damaged, malformed or does
            not match its digest (the message says which).
    """
    path = Path(path)
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        return load_manifest(dir_fd, path)

