"""The deployment files: Kubernetes manifests (deploy/kubernetes) and Slurm scripts (deploy/slurm).

Each Kubernetes pod's environment is built as its controller builds it — the
TFJob operator's ``TF_CONFIG`` (cluster from the replica specs, addresses
``<job>-<type>-<index>.<namespace>.svc:<port>``, the pod's type and index), the
downward API fields JobSet gives a pod, Kubernetes' ``$(VAR)`` expansion — and
resolved through towerflow's own resolver, which must name the pod's task in the
right cluster. Every file, Secret, port, probe and command the manifests refer to
must exist and agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from towerflow.cli._serving import bind_host
from towerflow.cluster import ClusterSpec, TaskInfo, resolve_cluster
from towerflow.cluster.threads import OMP_ENV, processes_on_host, thread_share

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
DOCS = REPO / "docs"
TFJOB_PORT = 2222  # the operator's default when no port is named tfjob-port
#: What the TFJob operator and the Job controller name a pod's fields.
POD_IP = "10.1.2.3"
#: The CPU limit of a task's container (the downward API's limits.cpu, whole cores).
POD_CPUS = "2"
#: Keys of the Secrets cert-manager writes for a Certificate.
CERT_KEYS = {"tls.crt", "tls.key", "ca.crt"}
TRAINING_JOBS = {"chief", "worker"}

Pod = tuple[str, int, dict[str, Any], dict[str, str]]  # (type, index, pod spec, env)


def _manifests() -> dict[str, list[dict[str, Any]]]:
    return {path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
            for path in sorted(K8S.glob("*.yaml"))}


def _of_kind(kind: str, manifests: dict[str, list[dict[str, Any]]] | None = None) -> list[dict]:
    docs = manifests if manifests is not None else _manifests()
    return [doc for file in docs.values() for doc in file if doc["kind"] == kind]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in env values, command and args (``$$`` escapes)."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _shell(text: str, env: dict[str, str]) -> str:
    """``$VAR`` / ``${VAR}`` as the container's shell expands them."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env[m.group(1)], text)


def _pod_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment; a field the pod does not have fails the lookup."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(str(var["value"]), env)
        elif "resourceFieldRef" in var["valueFrom"]:
            ref = var["valueFrom"]["resourceFieldRef"]
            assert str(ref.get("divisor", "1")) == "1", f"{var['name']}: whole cores, not {ref}"
            env[var["name"]] = fields[ref["resource"]]
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


# --------------------------------------------------------------------------- TFJob
def _tfjob_port(spec: dict[str, Any]) -> int:
    for container in spec["template"]["spec"]["containers"]:
        if container["name"] == "tensorflow":
            for port in container.get("ports", []):
                if port.get("name") == "tfjob-port":
                    return port["containerPort"]
    return TFJOB_PORT


def tfjob_pods(job: dict[str, Any]) -> Iterator[Pod]:
    """Every pod of a TFJob with the environment the operator gives its ``tensorflow`` container."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    specs = job["spec"]["tfReplicaSpecs"]
    cluster = {rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{_tfjob_port(spec)}"
                               for i in range(spec["replicas"])]
               for rtype, spec in specs.items() if rtype != "Evaluator"}
    for rtype, spec in specs.items():
        pod = spec["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "tensorflow"]
        for index in range(spec["replicas"]):
            fields = {"metadata.name": f"{name}-{rtype.lower()}-{index}",
                      "metadata.namespace": namespace, "status.podIP": POD_IP,
                      "limits.cpu": POD_CPUS}
            env = _pod_env(container, fields)
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "environment": "cloud",
                                           "task": {"type": rtype.lower(), "index": index}})
            yield rtype.lower(), index, pod, env


# --------------------------------------------------------------------------- JobSet
def _jobsets(manifests: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, dict]]:
    """(JobSet name, namespace, JobSet spec): each JobSet, and each TrainJob's runtime."""
    found = [(js["metadata"]["name"], js["metadata"]["namespace"], js["spec"])
             for js in _of_kind("JobSet", manifests)]
    runtimes = {(rt["metadata"]["namespace"], rt["metadata"]["name"]): rt
                for rt in _of_kind("TrainingRuntime", manifests)}
    for job in _of_kind("TrainJob", manifests):
        ref, namespace = job["spec"]["runtimeRef"], job["metadata"]["namespace"]
        assert (ref["kind"], ref.get("apiGroup")) == ("TrainingRuntime", "trainer.kubeflow.org")
        runtime = runtimes[(namespace, ref["name"])]
        found.append((job["metadata"]["name"], namespace, runtime["spec"]["template"]["spec"]))
    return found


def jobset_pods(name: str, namespace: str, spec: dict[str, Any]) -> Iterator[Pod]:
    """Every pod of a JobSet with the labels and annotations JobSet and the Job controller set."""
    for rjob in spec["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert rjob.get("replicas", 1) == 1 and job["completionMode"] == "Indexed"
        assert job["parallelism"] == job["completions"], rjob["name"]
        (container,) = job["template"]["spec"]["containers"]
        for index in range(job["parallelism"]):
            fields = {
                "metadata.labels['jobset.sigs.k8s.io/jobset-name']": name,
                "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']": rjob["name"],
                "metadata.labels['jobset.sigs.k8s.io/job-index']": "0",
                "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
                "metadata.namespace": namespace, "status.podIP": POD_IP, "limits.cpu": POD_CPUS}
            yield rjob["name"], index, job["template"]["spec"], _pod_env(container, fields)


# --------------------------------------------------------------------------- checks
def _resolved(kind: str, index: int, env: dict[str, str]) -> tuple[ClusterSpec, TaskInfo]:
    spec, task = resolve_cluster(env=env)
    assert spec is not None and task == TaskInfo(kind, index), (kind, index, task)
    return spec, task


def _provided_secrets(manifests: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], set]:
    """(namespace, Secret) -> keys: cert-manager Certificates and `kubectl create secret` lines."""
    provided = {(c["metadata"]["namespace"], c["spec"]["secretName"]): set(CERT_KEYS)
                for c in _of_kind("Certificate", manifests)}
    command = re.compile(r"kubectl -n (\S+) create secret generic (\S+) --from-(?:literal|file)=(\w+)=")
    for match in command.finditer((DOCS / "kubernetes.md").read_text()):
        provided.setdefault((match.group(1), match.group(2)), set()).add(match.group(3))
    return provided


def _secret_file(pod: dict[str, Any], path: str) -> tuple[str, str, int]:
    """(Secret, key, mode) of a file a container reads from a Secret volume."""
    (container,) = [c for c in pod["containers"] if c["name"] in ("tensorflow", "towerflow")]
    file = PurePosixPath(path)
    (mount,) = [m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == file.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume["secret"]["secretName"], file.name, volume["secret"].get("defaultMode", 0o644)


def check_pod_files(pod: dict[str, Any], env: dict[str, str], namespace: str,
                    manifests: dict[str, list[dict[str, Any]]]) -> None:
    """Every secret file the environment and the probe name comes from a provided Secret key."""
    provided = _provided_secrets(manifests)
    (container,) = [c for c in pod["containers"] if c["name"] in ("tensorflow", "towerflow")]
    probe = " ".join(container["livenessProbe"]["exec"]["command"])
    paths = [env[name] for name in ("TOWERFLOW_SECRET_FILE", "TOWERFLOW_TLS_CERT",
                                    "TOWERFLOW_TLS_KEY", "TOWERFLOW_TLS_CA")]
    paths += re.findall(r"-tls-(?:ca-cert|client-cert|client-key)=(\S+)", probe)
    assert len(paths) == 7, probe
    for path in paths:
        secret, key, mode = _secret_file(pod, path)
        assert key in provided.get((namespace, secret), set()), (path, secret, provided)
        assert mode & 0o077 == 0, f"{secret} is readable by others (mode {mode:o})"
    names = {n for c in _of_kind("Certificate", manifests) for n in c["spec"].get("dnsNames", [])}
    assert env["TOWERFLOW_TLS_SERVER_NAME"] in names
    assert '-tls-server-name="$TOWERFLOW_TLS_SERVER_NAME"' in probe


def check_pod_port(pod: dict[str, Any], env: dict[str, str], address: str) -> None:
    """The container listens, and is probed, on the port of its address in the cluster."""
    (container,) = [c for c in pod["containers"] if c["name"] in ("tensorflow", "towerflow")]
    port = int(address.rsplit(":", 1)[1])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    probe = _shell(" ".join(container["livenessProbe"]["exec"]["command"]), env)
    assert f"-addr={POD_IP}:{port} " in probe.replace('"', ""), probe


def _command(pod: dict[str, Any]) -> list[str]:
    (container,) = [c for c in pod["containers"] if c["name"] in ("tensorflow", "towerflow")]
    return [*container["command"], *container.get("args", [])]


def check_jobs(pods: list[Pod], manifests: dict[str, list[dict[str, Any]]], namespace: str,
               own_host: Any) -> ClusterSpec:
    """Each pod resolves to its own task of one cluster; files, ports and commands agree."""
    clusters = []
    for kind, index, pod, env in pods:
        spec, task = _resolved(kind, index, env)
        clusters.append(spec.as_dict())
        address = spec.task_address(kind, index)
        assert address.rsplit(":", 1)[0] == own_host(kind, index, env)
        check_pod_port(pod, env, address)
        check_pod_files(pod, env, namespace, manifests)
        # PyTorch's threads: the container's CPU limit, whatever the node's cores
        assert thread_share(64, processes_on_host(spec, task), env) == (int(POD_CPUS), OMP_ENV)
        if kind == "ps":
            assert _command(pod)[:2] == ["towerflow", "server"]
    assert all(cluster == clusters[0] for cluster in clusters)
    spec = ClusterSpec(clusters[0])
    assert sorted((k, i) for k, i, _, _ in pods) == sorted(
        (job, i) for job in spec.jobs for i in range(spec.num_tasks(job)))
    commands = {json.dumps(_command(pod)) for kind, _, pod, _ in pods if kind in TRAINING_JOBS}
    assert len(commands) == 1 and "train" in commands.pop(), "chief and workers run one command"
    return spec


# --------------------------------------------------------------------------- tests
def test_every_manifest_parses_and_names_one_namespace() -> None:
    manifests = _manifests()
    assert set(manifests) == {"tls.yaml", "tfjob.yaml", "jobset.yaml", "trainjob.yaml"}
    assert {doc["metadata"]["namespace"] for docs in manifests.values() for doc in docs} == {
        "towerflow"}


def test_tfjob_pods_resolve_to_their_replica_and_share_one_cluster() -> None:
    manifests = _manifests()
    (job,) = _of_kind("TFJob", manifests)
    pods = list(tfjob_pods(job))
    spec = check_jobs(pods, manifests, "towerflow",
                      lambda kind, index, env: f"digits-{kind}-{index}.towerflow.svc")
    assert spec.as_dict() == {
        "ps": ["digits-ps-0.towerflow.svc:2222"], "chief": ["digits-chief-0.towerflow.svc:2222"],
        "worker": ["digits-worker-0.towerflow.svc:2222", "digits-worker-1.towerflow.svc:2222"]}
    assert spec.is_chief(TaskInfo("chief", 0)) and not spec.is_chief(TaskInfo("worker", 0))
    # every task listens on all interfaces of its pod (its Service name resolves only once the
    # pod runs): the environment's --bind, read as the commands read it
    for _, _, pod, env in pods:
        assert bind_host(argparse.Namespace(bind=None), env) == "0.0.0.0"
        assert "--bind" not in _command(pod)
    assert _command(pods[0][2]) == ["towerflow", "server"]


def test_tfjob_ends_when_the_chief_has_finished_and_stops_the_ps() -> None:
    (job,) = _of_kind("TFJob")
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("Running", "All")
    if "Chief" not in job["spec"]["tfReplicaSpecs"]:
        assert job["spec"].get("successPolicy") == "AllWorkers"
    chief = job["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
    train_dir = PurePosixPath(_command(chief)[_command(chief).index("--train-dir") + 1])
    (container,) = chief["containers"]
    (mount,) = [m for m in container["volumeMounts"] if train_dir.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in chief["volumes"] if v["name"] == mount["name"]]
    claims = {pvc["metadata"]["name"] for pvc in _of_kind("PersistentVolumeClaim")}
    assert volume["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("which", ["jobset", "trainjob"])
def test_jobset_pods_resolve_to_their_task_under_their_own_host_name(which: str) -> None:
    manifests = _manifests()
    found = {name: (ns, spec) for name, ns, spec in _jobsets(manifests)}
    name = {"jobset": "digits-jobset", "trainjob": "digits-trainjob"}[which]
    namespace, spec = found[name]
    assert spec["network"]["enableDNSHostnames"] is True

    def own_host(kind: str, index: int, env: dict[str, str]) -> str:
        # the pod's name in its /etc/hosts: <hostname>.<subdomain>.<namespace>.svc.<domain>
        return f"{name}-{kind}-0-{index}.{name}.{namespace}.svc.cluster.local"

    cluster = check_jobs(list(jobset_pods(name, namespace, spec)), manifests, namespace, own_host)
    assert (cluster.num_tasks("ps"), cluster.num_tasks("chief"), cluster.num_tasks("worker")) == (
        1, 1, 2)
    policy = spec["successPolicy"]
    assert policy["operator"] == "All" and set(policy["targetReplicatedJobs"]) == TRAINING_JOBS


def test_images_run_the_dockerfile_with_the_probe_it_installs() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "/usr/local/bin/grpc_health_probe" in dockerfile and '".[digits]"' in dockerfile
    tag = re.search(r"docker build -f deploy/kubernetes/Dockerfile -t (\S+) \.", dockerfile)
    images = {c["image"] for docs in _manifests().values() for doc in docs
              for c in _containers(doc)}
    assert tag is not None and images == {tag.group(1)}


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "containers" in node:
            yield from node["containers"]
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def _broken(edit: str) -> dict[str, list[dict[str, Any]]]:
    manifests = copy.deepcopy(_manifests())
    (jobset,) = _of_kind("JobSet", manifests)
    worker = jobset["spec"]["replicatedJobs"][2]
    assert worker["name"] == "worker"
    pod = worker["template"]["spec"]["template"]["spec"]
    if edit == "parallelism":
        worker["template"]["spec"]["parallelism"] = worker["template"]["spec"]["completions"] = 3
    elif edit == "secret":
        pod["volumes"] = copy.deepcopy(pod["volumes"])
        pod["volumes"][0]["secret"]["secretName"] = "towerflow-secret"
    elif edit == "port":
        pod["containers"] = copy.deepcopy(pod["containers"])
        pod["containers"][0]["ports"][0]["containerPort"] = 2223
    return manifests


@pytest.mark.parametrize("edit", ["parallelism", "secret", "port"])
def test_the_checks_catch_a_broken_manifest(edit: str) -> None:
    manifests = _broken(edit)
    ((name, namespace, spec), *_) = _jobsets(manifests)
    with pytest.raises((AssertionError, KeyError, ValueError)):
        check_jobs(list(jobset_pods(name, namespace, spec)), manifests, namespace,
                   lambda kind, index, env: f"{name}-{kind}-0-{index}.{name}.{namespace}"
                   ".svc.cluster.local")


# --------------------------------------------------------------------------- docs
def _code_blocks(markdown: Path) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", markdown.read_text(), re.S | re.M)


@pytest.mark.parametrize(("doc", "files"), [
    ("slurm.md", ["deploy/slurm/ps.sbatch", "deploy/slurm/mirrored.sbatch"]),
    ("kubernetes.md", ["deploy/kubernetes/tfjob.yaml"]),
])
def test_the_documented_files_are_the_tested_ones(doc: str, files: list[str]) -> None:
    blocks = _code_blocks(DOCS / doc)
    for file in files:
        assert (REPO / file).read_text() in blocks, f"docs/{doc} does not show {file} as it is"
