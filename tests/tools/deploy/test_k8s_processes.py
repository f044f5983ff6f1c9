"""docker/k8s/'s commands run as processes: TLS, registration Job, a SuperNode (#31).

No cluster runs here; what a cluster would run can still run. The SuperLink
is started with the exact command of superlink.yaml, the register-supernodes
Job's script runs as written, and a SuperNode with the exact command of
supernode.yaml for pod ordinal 1 — each with the in-pod paths mapped onto a
temporary folder laid out as the pods' volumes (the certificates and keys
named as kustomization.yaml's generators name them, made by ``fedadapt
certs`` / ``node-keys``) and the Service address onto 127.0.0.1. Checks:
the Job registers every public key, a second run of it succeeds without
registering again, and the SuperNode of ordinal 1 is accepted with the key
its ordinal picks.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from fedadapt.tools.deploy.certs import make_certificates, make_node_keys
from fedadapt.tools.deploy.process import (
    Daemon,
    ProcessTree,
    flower_env,
    free_port,
    http_ok,
    online_supernodes,
    write_connection,
)
from tests.helpers import ROOT, assert_no_processes_under

pytestmark = pytest.mark.deploy

K8S = ROOT / "docker" / "k8s"
ORDINAL = 1


def _docs(name: str) -> dict[str, dict]:
    docs = yaml.safe_load_all((K8S / name).read_text())
    return {d["kind"]: d for d in docs}


def _generated_files(certs) -> dict[str, dict]:
    """Generator name -> {key: the file fedadapt wrote} (kustomization.yaml)."""
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = {}
    for gen in kustomize["secretGenerator"] + kustomize["configMapGenerator"]:
        pairs = (entry.split("=", 1) for entry in gen["files"])
        found[gen["name"]] = {key: certs / src.split("/")[-1] for key, src in pairs}
    return found


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_commands_register_and_admit_a_supernode(tmp_path):
    certs = tmp_path / "certs"
    make_certificates(certs, ["superlink", "localhost", "127.0.0.1"])
    make_node_keys(certs, 3)
    files = _generated_files(certs)
    port = free_port()
    address = f"127.0.0.1:{port}"

    # the pods' volumes, as folders: /certs (CA, server cert/key), /keys, ...
    pod_certs = tmp_path / "pod-certs"
    pod_certs.mkdir()
    shutil.copy(files["fedadapt-ca"]["ca.crt"], pod_certs / "ca.crt")
    shutil.copy(files["superlink-tls"]["tls.crt"], pod_certs / "server.crt")
    shutil.copy(files["superlink-tls"]["tls.key"], pod_certs / "server.key")
    keys, public_keys = tmp_path / "keys", tmp_path / "public-keys"
    keys.mkdir()
    public_keys.mkdir()
    for key, source in files["supernode-keys"].items():
        shutil.copy(source, keys / key)
    for key, source in files["supernode-public-keys"].items():
        shutil.copy(source, public_keys / key)

    def in_pod(arg: str) -> str:
        return (
            arg.replace("/certs/", f"{pod_certs}/")
            .replace("/keys/", f"{keys}/")
            .replace("/data/state.db", str(tmp_path / "state.db"))
            .replace("--host=0.0.0.0", "--host=127.0.0.1")
            .replace("--port=8000", f"--port={port}")
            .replace("superlink:8000", address)
            .replace("$(POD_INDEX)", str(ORDINAL))
        )

    tree = ProcessTree()
    deployment = _docs("superlink.yaml")["Deployment"]
    superlink_cmd = [in_pod(a) for a in _container(deployment)["command"]]
    superlink = Daemon(
        "SuperLink",
        superlink_cmd,
        tree.env(flower_env(tmp_path / "superlink")),
        tmp_path / "superlink.log",
    )
    statefulset = _docs("supernode.yaml")["StatefulSet"]
    supernode_cmd = [in_pod(a) for a in _container(statefulset)["command"]]
    # the Runtime API port: a pod has its own network, processes here share one
    supernode_cmd.append(f"--port={free_port()}")
    supernode = Daemon(
        "SuperNode",
        supernode_cmd,
        tree.env(flower_env(tmp_path / "supernode")),
        tmp_path / "supernode.log",
    )
    job = _docs("register-supernodes.yaml")
    config_toml = in_pod(job["ConfigMap"]["data"]["config.toml"])
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text(config_toml)
    script = _container(job["Job"])["command"][-1]
    assert "/config/" in script and "/public-keys/" in script
    script = script.replace("/config/", f"{tmp_path}/config/").replace(
        "/public-keys/", f"{public_keys}/"
    )
    job_env = tree.env(flower_env(tmp_path / "job-home"))

    def run_job(expected: str) -> None:
        """Run the Job's script: exit 0, ``expected`` once for each of 3 keys."""
        done = subprocess.run(
            ["sh", "-c", script],
            env=job_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count(expected) == 3, done.stdout

    try:
        superlink.start()
        superlink.wait_until(
            lambda: http_ok(f"https://{address}/health", pod_certs / "ca.crt"),
            60,
            "healthy",
        )
        run_job("registered successfully")
        run_job("registered before")  # a rerun of the Job is harmless

        supernode.start()
        cli_home = tmp_path / "cli"
        write_connection(cli_home, "k8s", address, pod_certs / "ca.crt")
        env = flower_env(cli_home)
        supernode.wait_until(
            lambda: len(online_supernodes(env, "k8s") or []) == 1,
            120,
            "online with the key of its ordinal",
        )
    finally:
        supernode.stop()
        superlink.stop()
    assert_no_processes_under(tmp_path)
