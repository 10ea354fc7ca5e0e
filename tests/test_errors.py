"""The error hierarchy: TensorFlow's canonical codes, Python's built-in bases, gRPC mapping."""

from __future__ import annotations

import doctest

import grpc
import pytest

from towerflow import errors


def test_every_code_maps_back_to_its_class_and_names_a_grpc_status() -> None:
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.TowerflowError)
               and c not in (errors.TowerflowError, errors.PlacementError,
                             errors.NanLossDuringTrainingError, errors.CheckpointError)]
    assert len(classes) == 12
    for cls in classes:
        assert errors.from_grpc_code(cls.grpc_code) is cls
        assert hasattr(grpc.StatusCode, cls.grpc_code)


def test_unknown_code_gives_the_base_class() -> None:
    assert errors.from_grpc_code("UNKNOWN") is errors.TowerflowError
    assert errors.from_grpc_code("NOT_A_CODE") is errors.TowerflowError


@pytest.mark.parametrize(("cls", "builtin"), [
    (errors.InvalidArgumentError, ValueError),
    (errors.PlacementError, ValueError),
    (errors.NotFoundError, LookupError),
    (errors.UnavailableError, ConnectionError),
    (errors.DeadlineExceededError, TimeoutError),
    (errors.UnauthenticatedError, PermissionError),
    (errors.ResourceExhaustedError, MemoryError),
])
def test_errors_are_also_the_builtin_a_python_user_catches(cls, builtin) -> None:
    assert issubclass(cls, builtin) and issubclass(cls, errors.TowerflowError)


def test_placement_and_nan_errors_keep_their_parents_codes() -> None:
    assert issubclass(errors.PlacementError, errors.InvalidArgumentError)
    assert errors.PlacementError.grpc_code == "INVALID_ARGUMENT"
    assert issubclass(errors.NanLossDuringTrainingError, errors.AbortedError)
    assert errors.NanLossDuringTrainingError.grpc_code == "ABORTED"
    assert issubclass(errors.CheckpointError, errors.DataLossError)
    assert errors.CheckpointError.grpc_code == "DATA_LOSS"


def test_docstring_examples_hold() -> None:
    assert doctest.testmod(errors).failed == 0
