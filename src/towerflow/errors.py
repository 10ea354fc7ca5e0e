"""The towerflow error hierarchy, after TensorFlow's canonical error codes.

Every error towerflow raises for a user's mistake or a cluster fault is a
:class:`TowerflowError`. The subclasses mirror TensorFlow's
``tf.errors`` codes so that code written against the articles reads the same,
and the gRPC status codes of the cluster transport map onto them
(:func:`from_grpc_code`; each class names its code in ``grpc_code``).

A message is one sentence that names the offending value and the way out::

    raise InvalidArgumentError(
        "Device string '/gpu:x' has a non-integer index; use a form such as '/gpu:0'.")
"""

from __future__ import annotations

__all__ = [
    "TowerflowError",
    "InvalidArgumentError",
    "PlacementError",
    "NotFoundError",
    "AlreadyExistsError",
    "UnavailableError",
    "DeadlineExceededError",
    "UnauthenticatedError",
    "PermissionDeniedError",
    "DataLossError",
    "CheckpointError",
    "AbortedError",
    "NanLossDuringTrainingError",
    "FailedPreconditionError",
    "ResourceExhaustedError",
    "InternalError",
    "from_grpc_code",
]


class TowerflowError(Exception):
    """Base class of every error towerflow raises on purpose."""

    #: Name of the matching gRPC status code (``grpc.StatusCode`` member).
    grpc_code: str = "UNKNOWN"


class InvalidArgumentError(TowerflowError, ValueError):
    """A value given by the user is malformed or out of range."""

    grpc_code = "INVALID_ARGUMENT"


class PlacementError(InvalidArgumentError):
    """An operation cannot be assigned to the device its scope asks for."""


class NotFoundError(TowerflowError, LookupError):
    """A file, checkpoint, device or task that was asked for does not exist."""

    grpc_code = "NOT_FOUND"


class AlreadyExistsError(TowerflowError):
    """Something that must be created once already exists."""

    grpc_code = "ALREADY_EXISTS"


class UnavailableError(TowerflowError, ConnectionError):
    """A peer task cannot be reached (not started yet, dead, or partitioned)."""

    grpc_code = "UNAVAILABLE"


class DeadlineExceededError(TowerflowError, TimeoutError):
    """An operation did not finish before its deadline."""

    grpc_code = "DEADLINE_EXCEEDED"


class UnauthenticatedError(TowerflowError, PermissionError):
    """A peer presented no credentials, or the wrong ones."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(TowerflowError, PermissionError):
    """A peer is known but not allowed to do what it asked."""

    grpc_code = "PERMISSION_DENIED"


class DataLossError(TowerflowError):
    """Stored or transmitted data is corrupt or truncated."""

    grpc_code = "DATA_LOSS"


class CheckpointError(DataLossError):
    """A checkpoint on disk is damaged, incomplete or not a towerflow checkpoint."""


class AbortedError(TowerflowError):
    """An operation was aborted, typically by a concurrent change (a stale step)."""

    grpc_code = "ABORTED"


class NanLossDuringTrainingError(AbortedError):
    """The loss (or a parameter) became NaN or infinite: the model diverged.

    Like TensorFlow's ``tf.train.NanLossDuringTrainingError``; training stops and no
    checkpoint of the diverged parameters is written.
    """


class FailedPreconditionError(TowerflowError):
    """The system is not in the state the operation needs (e.g. not initialised)."""

    grpc_code = "FAILED_PRECONDITION"


class ResourceExhaustedError(TowerflowError, MemoryError):
    """A size or memory limit was hit (a message too large, a GPU out of memory)."""

    grpc_code = "RESOURCE_EXHAUSTED"


class InternalError(TowerflowError):
    """An invariant of towerflow itself was broken; please report it."""

    grpc_code = "INTERNAL"


_BY_CODE: dict[str, type[TowerflowError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        UnavailableError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
        DataLossError,
        AbortedError,
        FailedPreconditionError,
        ResourceExhaustedError,
        InternalError,
    )
}


def from_grpc_code(code_name: str) -> type[TowerflowError]:
    """Return the error class for a gRPC status code name.

    Example:
        >>> from_grpc_code("UNAVAILABLE").__name__
        'UnavailableError'
    """
    return _BY_CODE.get(code_name, TowerflowError)
