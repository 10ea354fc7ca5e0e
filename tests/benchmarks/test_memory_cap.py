"""The memory cap under a build that maps large shared objects (benchmarks/sparse_worker_memory.py).

A CUDA build of torch maps shared objects with large private writable
segments: address space, not memory used. These tests stand such a build in
with a child that maps several GiB it never touches (a private writable file
mapping, as a shared object's data segment is, and an anonymous one), so they
need no CUDA: the benchmark's RSS cap lets it run, where ``RLIMIT_DATA`` of
the same size refuses the mapping; a child that touches more than the cap is
stopped, and the message names the cap.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from file_modules import load_file

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sparse_worker_memory.py"
CAP = 128 << 20
MAPPED = 2 << 30  # each of the two mappings: 4 GiB of address space in all, 32x the cap

#: maps a sparse file (private, writable) and anonymous memory, touches one page of each,
#: prints its data segment (the address space RLIMIT_DATA counts) in bytes
MAPS_A_LOT = r"""
import mmap, sys
size, path = int(sys.argv[1]), sys.argv[2]
with open(path, "r+b") as f:
    segment = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
anonymous = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
segment[0] = anonymous[0] = 1
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:")))
"""

#: touches 16 MiB more at a time up to argv[1] bytes, then waits to be stopped
TOUCHES_A_LOT = r"""
import signal, sys
chunks = [b"\x01" * (16 << 20) for _ in range(int(sys.argv[1]) // (16 << 20))]
signal.pause()
"""


def load_benchmark():  # noqa: ANN201 - the benchmark's module
    """``benchmarks/sparse_worker_memory.py`` as a module (its cap: ``run_under_rss_cap``)."""
    return load_file(BENCHMARK, "sparse_worker_memory")


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark's module
    return load_benchmark()


@pytest.fixture
def sparse_file(tmp_path: Path) -> Path:
    path = tmp_path / "segment"
    with path.open("wb") as f:
        f.truncate(MAPPED)  # sparse: no blocks
    return path


def test_a_child_mapping_far_more_than_the_cap_but_touching_little_runs_under_it(
        bench, sparse_file, subprocess_env) -> None:
    result = bench.run_under_rss_cap([sys.executable, "-c", MAPS_A_LOT, str(MAPPED),
                                      str(sparse_file)], CAP, env=subprocess_env, timeout=60)
    assert result["returncode"] == 0, result
    assert result["stopped"] is None and result["over_cap"] is None, result
    assert int(result["stdout"]) > 2 * MAPPED > CAP  # the address space is far over the cap
    # its own peak, not this process's (torch is in it, over the cap): measured from a small parent
    assert 0 < result["peak_rss"] < CAP, result


def test_rlimit_data_of_the_same_size_refuses_that_child(sparse_file, subprocess_env) -> None:
    # what a CUDA build's worker met under the old cap: the mapping counts, though never touched
    def limit() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_DATA, (CAP, CAP))

    proc = subprocess.run([sys.executable, "-c", MAPS_A_LOT, str(MAPPED), str(sparse_file)],
                          env=subprocess_env, preexec_fn=limit, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "Cannot allocate memory" in proc.stderr, proc.stderr


def test_a_child_touching_more_than_the_cap_is_stopped_and_the_message_names_the_cap(
        bench, subprocess_env) -> None:
    result = bench.run_under_rss_cap([sys.executable, "-c", TOUCHES_A_LOT, str(4 * CAP)], CAP,
                                     env=subprocess_env, timeout=60)
    assert result["returncode"] == -9, result
    assert result["stopped"] == result["over_cap"], result
    assert result["over_cap"].startswith("stopped: its resident memory (RSS) "), result
    assert result["over_cap"].endswith("went over the cap of 128 MiB"), result
    # stopped on the way, not at the end (ru_maxrss is the kernel's approximate count: about CAP)
    assert CAP // 2 < result["peak_rss"] < 4 * CAP, result


def test_a_child_still_running_at_the_timeout_is_stopped(bench, subprocess_env) -> None:
    result = bench.run_under_rss_cap([sys.executable, "-c", "import signal; signal.pause()"],
                                     CAP, env=subprocess_env, timeout=1)
    assert result["returncode"] == -9, result
    assert result["stopped"] == "stopped: still running after 1 s", result
    assert result["over_cap"] is None, result
