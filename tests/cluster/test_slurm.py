"""A real Slurm cluster on this machine runs the batch scripts of ``deploy/slurm/``.

``scripts/slurm-local.sh start`` (run by ``.ci/run``) starts munged, slurmctld and
slurmd on localhost; the module fixture starts it again, which is a no-op when it
runs, and skips with the script's reason where Slurm is not installed or its
daemons cannot be started here. Each test submits the documented batch script as
it is, with ``sbatch``; the tasks learn their cluster from Slurm's ``SLURM_*``
variables through towerflow's Slurm resolver, train on loopback and the job ends
by itself. A job is cancelled whenever its test fails.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from towerflow.checkpoint import read_checkpoint
from towerflow.cluster.launcher import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm-local.sh"
DEPLOY = REPO / "deploy" / "slurm"
#: The local cluster's directory, as scripts/slurm-local.sh chooses it.
SLURM_DIR = Path(os.environ.get("TOWERFLOW_SLURM_DIR", "/var/lib/towerflow-slurm"))
JOB_SECONDS = 180
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
#: What the submitting environment must not hand the job: another cluster's variables.
FOREIGN = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
           "MASTER_PORT", "TOWERFLOW_")


def _slurm(args: list[str], env: dict[str, str], timeout: float = 30) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """The environment that submits to the local cluster (started here if it is not up, and
    then stopped here when the module's tests are done: the tests leave no daemon behind)."""
    running = subprocess.run([str(SLURM_LOCAL), "status"], capture_output=True, text=True,
                             timeout=60).returncode == 0
    done = subprocess.run([str(SLURM_LOCAL), "start", "--no-install"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"no local Slurm cluster ({SLURM_LOCAL.name} start exited "
                    f"{done.returncode}): {done.stderr.strip()}")
    conf = re.fullmatch(r"export SLURM_CONF=(\S+)\n",
                        _slurm([str(SLURM_LOCAL), "env"], dict(os.environ)))
    assert conf is not None
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and not k.startswith(FOREIGN)}
    env.update(SLURM_CONF=conf.group(1), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    try:
        yield env
    finally:
        if not running:  # started for these tests: stopped with them
            subprocess.run([str(SLURM_LOCAL), "stop"], capture_output=True, text=True,
                           timeout=120)


def _consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (task k listens on base+k)."""
    for base in free_ports(20):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError(f"no {count} consecutive free ports on 127.0.0.1")


def _job_fields(job: str, env: dict[str, str]) -> dict[str, str]:
    line = _slurm(["scontrol", "--oneliner", "show", "job", job], env)
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _wait_finished(job: str, env: dict[str, str], deadline: float) -> dict[str, str]:
    while time.monotonic() < deadline:
        fields = _job_fields(job, env)
        if fields["JobState"] in FINISHED:
            return fields
        time.sleep(0.5)
    raise AssertionError(f"Slurm job {job} still {fields['JobState']} after {JOB_SECONDS} s")


@pytest.fixture
def submit(slurm_env: dict[str, str], tmp_path: Path) -> Iterator:
    """Submit a batch script of deploy/slurm from ``tmp_path``; cancel the job if still there."""
    jobs: list[str] = []

    def run(script: str, sbatch_args: list[str], train_args: list[str],
            env: dict[str, str]) -> tuple[dict[str, str], str]:
        out = tmp_path / "job.out"
        job = _slurm(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={out}",
                      "--time=5", *sbatch_args, str(DEPLOY / script), *train_args],
                     {**slurm_env, **env}).strip().split(";")[0]
        jobs.append(job)
        fields = _wait_finished(job, slurm_env, time.monotonic() + JOB_SECONDS)
        text = out.read_text() if out.exists() else "(no output)"
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
            f"job {job}: {fields['JobState']} exit {fields['ExitCode']}\n{text}")
        return fields, text

    yield run
    for job in jobs:
        if _slurm(["squeue", "--noheader", "--jobs", job], slurm_env).strip():
            subprocess.run(["scancel", job], env=slurm_env, timeout=30, check=False)


def test_local_cluster_start_is_a_no_op_when_it_runs(slurm_env: dict[str, str]) -> None:
    pids = {name: (SLURM_DIR / "run" / f"{name}.pid").read_text()
            for name in ("munged", "slurmctld", "slurmd")}
    done = subprocess.run([str(SLURM_LOCAL), "start", "--no-install"], capture_output=True,
                          text=True, timeout=120, check=True)
    assert "already running; node localhost is idle" in done.stderr
    assert pids == {name: (SLURM_DIR / "run" / f"{name}.pid").read_text() for name in pids}
    assert _slurm(["sinfo", "--noheader", "--Node", "--format=%N %T"], slurm_env).split() == [
        "localhost", "idle"]


def _node_certificates(directory: Path, node: str) -> Path:
    """A CA and the node's certificate, as docs/cluster.md makes them (ca.pem, NODE.pem/.key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    directory.mkdir()
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=towerflow-ca")
    openssl("req", *ec, "-keyout", f"{node}.key", "-out", f"{node}.csr", "-subj", f"/CN={node}")
    (directory / f"{node}.ext").write_text(f"subjectAltName=DNS:{node}\n")
    openssl("x509", "-req", "-in", f"{node}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{node}.pem", "-days", "2", "-extfile", f"{node}.ext")
    return directory


def test_ps_job_trains_through_the_slurm_resolver_and_ends(submit, tmp_path: Path) -> None:
    # with TLS where openssl can make the node's certificate (the secret is always there)
    env = {"TOWERFLOW_PORT": str(base := _consecutive_free_ports(3))}
    tls = shutil.which("openssl") is not None
    if tls:
        env["TOWERFLOW_TLS_DIR"] = str(_node_certificates(tmp_path / "tls", "localhost"))
    started = time.monotonic()
    fields, out = submit("ps.sbatch", ["--nodes=1", "--ntasks=3", "--overcommit"],
                         ["digits", "--train-dir", str(tmp_path / "train"), "--max-steps", "300",
                          "--log-every", "100", "--checkpoint-every", "0", "--no-progress"],
                         env)
    print(f"ps job {fields['JobId']}: {time.monotonic() - started:.1f} s submit to end")
    # task 0 is ps:0, tasks 1 and 2 are workers 0 and 1, on TOWERFLOW_PORT + k of the node
    assert f"0: ps task 0 serving at grpc://localhost:{base}" in out
    assert f"1: started /job:worker/replica:0/task:0 at grpc://localhost:{base + 1}" in out
    assert f"2: started /job:worker/replica:0/task:1 at grpc://localhost:{base + 2}" in out
    assert read_checkpoint(tmp_path / "train").step >= 300
    for task in range(3):
        assert (f"{task}: TLS with {tmp_path}/tls/localhost.pem" in out) == tls, out
    secret = tmp_path / ".towerflow-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text()) == 64
    assert not list(tmp_path.glob(".towerflow-done-*"))


def test_mirrored_job_trains_two_replicas_and_ends(submit, tmp_path: Path) -> None:
    base = _consecutive_free_ports(2)
    _, out = submit("mirrored.sbatch", ["--nodes=1", "--ntasks=2", "--overcommit"],
                    ["digits", "--train-dir", str(tmp_path / "train"), "--max-steps", "60",
                     "--log-every", "20", "--checkpoint-every", "0", "--no-progress"],
                    {"TOWERFLOW_PORT": str(base)})
    ckpt = read_checkpoint(tmp_path / "train")
    assert (ckpt.step, ckpt.metadata["world_size"]) == (60, 2), out
