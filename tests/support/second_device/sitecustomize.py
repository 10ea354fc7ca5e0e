"""Started by every Python process whose ``PYTHONPATH`` begins with this folder: PyTorch's
lazy-tensor device (``lazy``, computed by TorchScript on the CPU) made ready, so that a
program run with ``TOWERFLOW_DEVICE=lazy`` computes its model on a device other than the
one its batches come from, as on a machine with a GPU (``tests/devices/test_transfer.py``).

At exit the process says how many operations ran on that device (copies apart), so a test
knows the model did compute there: ``second device: N ops``.
"""

import atexit
import sys

import torch._lazy.metrics
import torch._lazy.ts_backend

torch._lazy.ts_backend.init()


def _report() -> None:
    ops = sum(torch._lazy.metrics.counter_value(name) or 0
              for name in torch._lazy.metrics.counter_names()
              if name.startswith("lazy::") and name != "lazy::_to_copy")
    print(f"second device: {ops} ops", file=sys.stderr, flush=True)


atexit.register(_report)
