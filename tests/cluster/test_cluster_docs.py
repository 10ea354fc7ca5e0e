"""docs/cluster.md's TFJob and Slurm snippets follow the rules a task off loopback obeys.

Off loopback a server refuses to start without the cluster secret and TLS; a pod's own Service
name resolves only once the pod runs. The snippets must give every task the secret and a
certificate, make every pod's task listen where it can, and pick TLS files as the tested
Slurm script does.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from towerflow.cli.train import add_train_arguments, bind_host

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "cluster.md"
NEEDED = {"TOWERFLOW_SECRET_FILE", "TOWERFLOW_TLS_CERT", "TOWERFLOW_TLS_KEY", "TOWERFLOW_TLS_CA"}


def _block(language: str, marker: str) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), re.S | re.M)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/cluster.md has {len(found)} {language} blocks with {marker!r}"
    return found[0]


def _command_binds(argv: list[str], env: dict[str, str]) -> str | None:
    """Where the task's server listens (None: the unresolvable spec host)."""
    assert argv[0] == "towerflow", argv
    if argv[1] == "train":
        args = add_train_arguments(argparse.ArgumentParser()).parse_args(argv[2:])
        return bind_host(args, env)
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", default=None)
    return parser.parse_known_args(argv[2:])[0].bind


def test_tfjob_snippet_gives_every_task_the_secret_tls_and_a_listening_address() -> None:
    job = yaml.safe_load(_block("yaml", "kind: TFJob"))
    replicas = job["spec"]["tfReplicaSpecs"]
    assert {"PS", "Worker"} <= set(replicas)
    for kind, replica in replicas.items():
        pod = replica["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "tensorflow"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert NEEDED | {"TOWERFLOW_TLS_SERVER_NAME"} <= set(env), kind
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in secrets]
        for name in NEEDED:
            assert any(env[name].startswith(m + "/") for m in mounts), (kind, name, env[name])
        argv = [*container["command"], *container.get("args", [])]
        assert _command_binds(argv, env) == "0.0.0.0", (kind, argv)
        assert "--insecure" not in argv


def _lines(text: str) -> set[str]:
    return {re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()} - {""}


def test_slurm_snippet_takes_the_secret_and_each_nodes_certificate_as_the_tested_script() -> None:
    snippet = _block("bash", "srun")
    tested = _lines((REPO / "deploy" / "slurm" / "ps.sbatch").read_text())
    tls = {line for line in _lines(snippet) if "TOWERFLOW_TLS_" in line and "export" in line
           and "TOWERFLOW_TLS_DIR=" not in line}
    assert {name.split("=")[0].removeprefix("export ") for name in tls} == {
        "TOWERFLOW_TLS_CA", "TOWERFLOW_TLS_CERT", "TOWERFLOW_TLS_KEY"}
    assert tls <= tested, tls - tested
    assert "$SLURMD_NODENAME.pem" in snippet and "TOWERFLOW_SECRET_FILE=" in snippet
    assert "towerflow train" in snippet and "--insecure" not in snippet
