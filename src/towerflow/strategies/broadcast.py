"""One replica's checkpoint, handed to every replica through the process group.

When mirrored replicas resume, only replica 0 reads its train dir; the others
receive what it read, so no node needs a shared file system (and a replica's
own disk, empty or holding an older run, is never read). On the wire, all of
it through ``torch.distributed.broadcast`` and nothing pickled:

1. a header: its length, then UTF-8 JSON in a ``uint8`` tensor — whether
   there is a checkpoint, its path, step and metadata, and per group the
   name, dtype and shape of every tensor in order (or the error replica 0
   met reading it, raised on every replica);
2. the tensors' bytes, one after the other in one ``uint8`` buffer, split and
   viewed as their dtypes and shapes on arrival.

A receiving replica checks what it is sent before it allocates anything: the
header's length (at most :data:`MAX_HEADER_BYTES`), UTF-8 JSON nested at most
:data:`MAX_DEPTH` deep, exactly the fields above with their types,
non-negative shapes, and a total of tensor bytes the machine has memory for;
anything else is one ``DataLossError`` naming what is wrong.

Example (inside an initialised process group)::

    ckpt = broadcast_checkpoint(manager.restore() if rank == 0 else None, rank=rank,
                                device=torch.device("cpu"))
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from towerflow.checkpoint import Checkpoint
from towerflow.checkpoint.files import json_depth_exceeds
from towerflow.checkpoint.format import dtype_name
from towerflow.errors import AbortedError, DataLossError, FailedPreconditionError, TowerflowError

__all__ = ["broadcast_checkpoint", "share_read", "MAX_HEADER_BYTES", "MAX_DEPTH"]

#: longest checkpoint header a replica accepts (metadata and the tensors' names and shapes)
MAX_HEADER_BYTES = 64 << 20
#: deepest nesting of the header's JSON (the checkpoint's metadata included)
MAX_DEPTH = 64


def _refuse(src: int, what: str) -> DataLossError:
    return DataLossError(
        f"the checkpoint header replica {src} sent is malformed: {what[:300]}; nothing was "
        "allocated. Run the same towerflow on every replica and start them again."
    )


def _checked_size(size: int, src: int) -> int:
    """The header length replica ``src`` announced, if it is one to allocate."""
    if not 0 <= size <= MAX_HEADER_BYTES:
        raise _refuse(src, f"its length is {size} bytes, not 0 .. {MAX_HEADER_BYTES}")
    return size


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def parse_header(data: bytes, src: int = 0) -> dict[str, Any]:
    """The header replica ``src`` sent, checked: ``{"error": str}`` or ``{"checkpoint": None |
    {"path": str, "step": int, "metadata": dict, "tensors": [[group, name, dtype, shape]...]}}``.

    Raises:
        DataLossError: anything else (not UTF-8, not JSON, nested too deep,
            a field missing or of another type, a negative dimension).
    """
    if json_depth_exceeds(data, MAX_DEPTH):
        raise _refuse(src, f"it is nested more than {MAX_DEPTH} levels deep")
    try:
        header = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _refuse(src, "it is not UTF-8") from None
    except ValueError as exc:
        raise _refuse(src, f"it is not JSON ({exc})") from None
    if not isinstance(header, dict) or set(header) not in ({"error"}, {"checkpoint"}):
        raise _refuse(src, "it is not an object with exactly 'error' or 'checkpoint'")
    if "error" in header:
        if not isinstance(header["error"], str):
            raise _refuse(src, "its 'error' is not a string")
        return header
    found = header["checkpoint"]
    if found is None:
        return header
    if not (isinstance(found, dict) and set(found) == {"path", "step", "metadata", "tensors"}
            and isinstance(found["path"], str) and type(found["step"]) is int
            and isinstance(found["metadata"], dict) and isinstance(found["tensors"], list)):
        raise _refuse(src, "its 'checkpoint' is not an object of path, step, metadata and tensors")
    for i, entry in enumerate(found["tensors"]):
        if not (isinstance(entry, list) and len(entry) == 4
                and all(isinstance(x, str) for x in entry[:3]) and isinstance(entry[3], list)
                and len(entry[3]) <= 32 and all(_is_count(d) for d in entry[3])):
            raise _refuse(src, f"tensor entry {i} is not [group, name, dtype, shape of "
                               "non-negative integers]")
    return header


def _dtype(name: str) -> torch.dtype:
    """The torch dtype a header names (``float32``...), as :func:`dtype_name` wrote it."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FailedPreconditionError(
            f"replica 0 sent a tensor of dtype {name!r}, which this replica's torch "
            f"{torch.__version__} does not have; run the same torch on every replica."
        )
    return dtype


def _entries(ckpt: Checkpoint) -> list[tuple[str, str, torch.Tensor]]:
    return [(group, name, tensor) for group, tensors in ckpt.groups.items()
            for name, tensor in tensors.items()]


def _header(ckpt: Checkpoint | None, error: TowerflowError | None) -> dict[str, Any]:
    if error is not None:
        return {"error": f"{type(error).__name__}: {error}"}
    if ckpt is None:
        return {"checkpoint": None}
    if ckpt.chunked:
        return {"error": f"FailedPreconditionError: checkpoint {ckpt.path} holds chunked "
                f"groups {sorted(ckpt.chunked)} (a parameter server's sparse tables), which "
                "mirrored replicas do not restore; resume it with the strategy that wrote it."}
    return {"checkpoint": {
        "path": str(ckpt.path), "step": ckpt.step, "metadata": ckpt.metadata,
        "tensors": [[group, name, dtype_name(t.dtype), list(t.shape)]
                    for group, name, t in _entries(ckpt)]}}


def _send_bytes(data: bytes | None, src: int, device: torch.device) -> bytes:
    """``data`` of replica ``src``, on every replica."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
              if data is not None else
              torch.empty(_checked_size(int(size), src), dtype=torch.uint8, device=device))
    dist.broadcast(buffer, src)
    return buffer.cpu().numpy().tobytes()


def _check_memory(nbytes: int, src: int) -> None:
    """Refuse a tensor total this machine has not the memory for (twice: buffer and copies)."""
    import psutil

    available = psutil.virtual_memory().available
    if 2 * nbytes > available:
        raise _refuse(src, f"its tensors add up to {nbytes:,} bytes, more than half of the "
                           f"{available:,} bytes available here")


def _as_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def _send_tensors(ckpt: Checkpoint | None, layout: list[list[Any]], src: int,
                  device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of ``layout`` in one broadcast buffer; the groups on every replica."""
    specs = [(group, name, _dtype(dtype), torch.Size(shape)) for group, name, dtype, shape
             in layout]
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
             for _, _, dtype, shape in specs]
    if ckpt is None:
        _check_memory(sum(sizes), src)
    if ckpt is not None:
        parts = [_as_bytes(t, device) for _, _, t in _entries(ckpt)]
        buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for (group, name, dtype, shape), size in zip(specs, sizes, strict=True):
        piece = buffer[offset:offset + size].clone()  # own storage: aligned for any dtype
        groups.setdefault(group, {})[name] = piece.view(dtype).reshape(shape)
        offset += size
    return groups


def broadcast_checkpoint(ckpt: Checkpoint | None, *, rank: int, device: torch.device,
                         src: int = 0, error: TowerflowError | None = None) -> Checkpoint | None:
    """Replica ``src``'s checkpoint (or None: every replica starts fresh) on every replica.

    Args:
        ckpt: what replica ``src`` read (ignored elsewhere).
        rank: this replica's rank.
        device: where the collective's tensors live (a GPU for NCCL).
        src: the replica that read the checkpoint.
        error: the error replica ``src`` met reading it; every replica raises it.

    Raises:
        AbortedError: replica ``src`` could not read its checkpoint (its error is
            named; ``src`` re-raises its own).
    """
    sender = rank == src
    text = json.dumps(_header(ckpt, error)).encode() if sender else None
    received = _send_bytes(text, src, device)
    header = json.loads(received) if sender else parse_header(received, src)
    if "error" in header:
        if sender and error is not None:
            raise error
        if sender:
            raise FailedPreconditionError(header["error"].partition(": ")[2])
        raise AbortedError(
            f"replica {src} could not restore the checkpoint every replica resumes from "
            f"({header['error']}); fix its train dir and start the replicas again."
        )
    found = header["checkpoint"]
    if found is None:
        return None
    groups = _send_tensors(ckpt if sender else None, found["tensors"], src, device)
    if sender and ckpt is not None:
        return ckpt
    return Checkpoint(path=Path(found["path"]), step=int(found["step"]), groups=groups,
                      metadata=found["metadata"])


def share_read(read: Callable[[], Checkpoint | None], *, rank: int, device: torch.device,
               src: int = 0) -> Checkpoint | None:
    """``read()`` on replica ``src`` only; its checkpoint (or its error) on every replica."""
    ckpt: Checkpoint | None = None
    error: TowerflowError | None = None
    if rank == src:
        try:
            ckpt = read()
        except TowerflowError as exc:
            error = exc
    return broadcast_checkpoint(ckpt, rank=rank, device=device, src=src, error=error)
