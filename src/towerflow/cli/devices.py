"""``towerflow devices``: list this machine's devices (``device_lib.list_local_devices()``).

Examples:
    towerflow devices                 # a table
    towerflow devices --json          # [{"name": "/device:CPU:0", "device_type": "CPU", ...}]
    CUDA_VISIBLE_DEVICES=2,0 towerflow devices
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``devices`` command (no torch import here)."""
    parser = subparsers.add_parser(
        "devices",
        help="list the local devices (CPU and visible GPUs)",
        description="List the devices of this machine as TensorFlow's "
        "device_lib.list_local_devices() does: name, device_type, memory_limit, locality, "
        "incarnation and physical_device_desc (--json). CUDA_VISIBLE_DEVICES is honoured.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list of objects instead of a table"
    )
    parser.add_argument(
        "--visible-devices",
        metavar="LIST",
        default=None,
        help="GPUs to show, in order, like CUDA_VISIBLE_DEVICES (e.g. 2,0)",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        metavar="F",
        type=float,
        default=None,
        help="report each GPU's memory limit under this per-process fraction (0, 1]",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the devices; returns the exit status."""
    from towerflow.devices import configure, list_local_devices

    options: dict[str, Any] = {}
    if args.visible_devices is not None:
        options["visible_devices"] = args.visible_devices
    if args.gpu_memory_fraction is not None:
        options["gpu_memory_fraction"] = args.gpu_memory_fraction
    if options:
        configure(**options)
    devices = list_local_devices()
    if args.json:
        json.dump([d.as_dict() for d in devices], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print_table(devices)
    return 0


def _print_table(devices: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Local devices")
    table.add_column("name", no_wrap=True)
    table.add_column("device_type")
    table.add_column("memory_limit", justify="right")
    table.add_column("physical_device_desc")
    for info in devices:
        gib = info.memory_limit / (1 << 30)
        table.add_row(
            info.name,
            info.device_type,
            f"{info.memory_limit} ({gib:.1f} GiB)",
            info.physical_device_desc,
        )
    Console(width=160).print(table)
