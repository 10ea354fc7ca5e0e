"""towerflow: TensorFlow's acceleration system for PyTorch users.

Device placement you can see and control, synchronous multi-GPU training, and a
parameter-server cluster (ps, workers, a chief) that is authenticated and
fault tolerant.

Public names are imported lazily (PEP 562), so ``import towerflow`` is cheap
and the command line starts fast; ``towerflow.DeviceSpec`` imports the device
model on first use.

Example:
    >>> import towerflow
    >>> towerflow.DeviceSpec.from_string("/gpu:1").to_string()
    '/device:GPU:1'
"""

from __future__ import annotations

from towerflow import _grpc_log, errors  # noqa: F401 - _grpc_log: before gRPC loads
from towerflow._lazy import lazy_dir, lazy_getattr
from towerflow.errors import (
    AbortedError,
    DataLossError,
    DeadlineExceededError,
    InvalidArgumentError,
    NanLossDuringTrainingError,
    NotFoundError,
    PlacementError,
    TowerflowError,
    UnauthenticatedError,
    UnavailableError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # devices
    "DeviceSpec": "towerflow.devices",
    "DeviceInfo": "towerflow.devices",
    "list_local_devices": "towerflow.devices",
    "device": "towerflow.devices",
    "configure": "towerflow.devices",
    "resolve_device": "towerflow.devices",
    "get_config": "towerflow.devices",
    "move_to_device": "towerflow.devices",
    # checkpoint
    "save": "towerflow.checkpoint",
    "load": "towerflow._public",
    "CheckpointManager": "towerflow.checkpoint",
    "latest_checkpoint": "towerflow.checkpoint",
    "Checkpoint": "towerflow.checkpoint",
    "read_checkpoint": "towerflow.checkpoint",
    # serving
    "export": "towerflow.serving",
    "serving": "towerflow.serving",
    # cluster
    "ClusterSpec": "towerflow.cluster",
    "Server": "towerflow.cluster",
    "ServerOptions": "towerflow.cluster",
    "TaskInfo": "towerflow.cluster",
    "Credentials": "towerflow.cluster",
    "resolve_cluster": "towerflow.cluster",
    "HeartbeatMonitor": "towerflow.cluster.heartbeat",
    "HeartbeatOptions": "towerflow.cluster.heartbeat",
    # parameter server
    "replica_device_setter": "towerflow.ps",
    "run_ps_task": "towerflow.ps",
    "ShardedEmbedding": "towerflow.ps.worker.tables.embedding",
    "DynamicEmbedding": "towerflow._local_tables",
    # strategies
    "SingleDevice": "towerflow.strategies",
    "Mirrored": "towerflow.strategies",
    "ParameterServer": "towerflow.strategies",
    "OptimizerConfig": "towerflow.strategies",
    # training
    "Trainer": "towerflow.training",
    "Supervisor": "towerflow.training",
    "TrainConfig": "towerflow.training",
    "run_training": "towerflow.training",
}

__all__ = [
    "errors",
    "TowerflowError",
    "InvalidArgumentError",
    "PlacementError",
    "NotFoundError",
    "UnavailableError",
    "DeadlineExceededError",
    "UnauthenticatedError",
    "DataLossError",
    "AbortedError",
    "NanLossDuringTrainingError",
    *sorted(_LAZY),
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__dir__ = lazy_dir(globals(), __all__)
