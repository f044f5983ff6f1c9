"""docker/k8s/: the Kubernetes manifests, validated offline (issue #31 item 6).

No cluster runs here, so the manifests are checked three ways:

- against the Kubernetes API schemas that ``kubernetes-validate`` bundles
  (strict: an unknown or misspelt field fails), for the oldest Kubernetes the
  manifests support (1.28: the ``apps.kubernetes.io/pod-index`` label) and the
  newest schema bundled;
- by cross-checks a schema cannot make: Service selectors select the pods
  they serve and name their ports, every Secret, ConfigMap and volume
  referenced exists (with the keys used), every path a Flower flag reads lies
  in a mounted volume that provides that file — for every pod ordinal —,
  every flag exists in the installed daemon, and each SuperNode's node config
  (read with Flower's own parser) names its own read-only data volume;
- on what ``kubectl kustomize`` renders from certificates and keys made by
  ``fedadapt certs`` / ``fedadapt node-keys`` (skipped without kubectl).

Each check is also run on a broken copy, to show that it fails.
"""

from __future__ import annotations

import base64
import copy
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from flwr.common.config import parse_config_args

from tests.helpers import ROOT, daemon_has_flag

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the dev extra's kubernetes-validate"
)

K8S = ROOT / "docker" / "k8s"
# 1.28: pod-index label (beta, on by default); the newest bundled schema
VERSIONS = ["1.28", kubernetes_validate.utils.latest_version()]
WORKLOADS = {"Deployment", "StatefulSet", "Job", "Pod"}
DAEMONS = {"flower-superlink", "flower-supernode", "flower-superexec"}
# flags whose value is a file the daemon reads (or, --database, writes)
PATH_FLAGS = {
    "--ssl-ca-certfile",
    "--ssl-certfile",
    "--ssl-keyfile",
    "--root-certificates",
    "--auth-supernode-private-key",
    "--database",
}
POD_INDEX = "$(POD_INDEX)"

Doc = dict[str, Any]


# -- reading -------------------------------------------------------------------


def manifests(folder: Path = K8S) -> list[Doc]:
    """Every object of every manifest file (not kustomization.yaml)."""
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def kustomization(folder: Path = K8S) -> Doc:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def generated(kustomize: Doc) -> list[Doc]:
    """The Secrets and ConfigMaps the kustomization's generators make.

    Keys as the generators name them; values are placeholders (the files are
    made per deployment and are not in the repository).
    """
    docs = []
    for kind, field in (
        ("Secret", "secretGenerator"),
        ("ConfigMap", "configMapGenerator"),
    ):
        for gen in kustomize.get(field, []):
            keys = [entry.split("=", 1)[0] for entry in gen["files"]]
            doc: Doc = {
                "apiVersion": "v1",
                "kind": kind,
                "metadata": {"name": gen["name"]},
            }
            if kind == "Secret":
                doc["type"] = gen.get("type", "Opaque")
                doc["data"] = {k: base64.b64encode(b"x").decode() for k in keys}
            else:
                doc["data"] = {k: "x" for k in keys}
            docs.append(doc)
    return docs


def objects(kind: str, docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(doc: Doc) -> Doc:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def pod_labels(doc: Doc) -> dict[str, str]:
    meta = (
        doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]
    )
    return meta.get("labels", {})


def ordinals(doc: Doc) -> list[int | None]:
    """Pod ordinals a workload's command is expanded for (None: no ordinal)."""
    if doc["kind"] == "StatefulSet":
        return list(range(doc["spec"].get("replicas", 1)))
    return [None]


def expand(arg: str, ordinal: int | None) -> str:
    return arg if ordinal is None else arg.replace(POD_INDEX, str(ordinal))


def flag_value(command: list[str], flag: str) -> str | None:
    for arg in command:
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


# -- the checks: each returns a list of problems (empty: fine) --------------------


def schema_problems(docs: list[Doc], version: str) -> list[str]:
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = "/".join(map(str, err.absolute_path))
            problems.append(
                f"{doc['kind']}/{doc['metadata']['name']} {where}: {err.message}"
            )
    return problems


def _volume_files(volume: Doc, docs: list[Doc]) -> tuple[set[str] | None, list[str]]:
    """(files the volume provides, or None for a data volume; problems)."""
    sources = []
    if "secret" in volume:
        sources = [("Secret", volume["secret"]["secretName"], volume["secret"])]
    elif "configMap" in volume:
        sources = [("ConfigMap", volume["configMap"]["name"], volume["configMap"])]
    elif "projected" in volume:
        for src in volume["projected"]["sources"]:
            kind = "Secret" if "secret" in src else "ConfigMap"
            body = src.get("secret") or src.get("configMap")
            sources.append((kind, body["name"], body))
    else:
        return None, []
    files: set[str] = set()
    problems = []
    for kind, name, body in sources:
        obj = objects(kind, docs).get(name)
        if obj is None:
            problems.append(f"volume {volume['name']}: no {kind} {name}")
            continue
        keys = set(obj.get("data", {})) | set(obj.get("stringData", {}))
        items = body.get("items")
        if items is None:
            files |= keys
        for item in items or []:
            if item["key"] not in keys:
                problems.append(
                    f"volume {volume['name']}: {kind} {name} has no key {item['key']}"
                )
            files.add(item["path"])
    return files, problems


def _service_problems(docs: list[Doc]) -> list[str]:
    problems = []
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    for name, svc in objects("Service", docs).items():
        selector = svc["spec"].get("selector") or {}
        chosen = [
            w
            for w in workloads
            if selector and selector.items() <= pod_labels(w).items()
        ]
        if len(chosen) != 1:
            found = [w["metadata"]["name"] for w in chosen]
            problems.append(f"Service {name}: selector {selector} selects {found}")
            continue
        containers = pod_spec(chosen[0])["containers"]
        ports = [p for c in containers for p in c.get("ports", [])]
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                problems.append(f"Service {name}: no container port {target}")
    for name, sts in objects("StatefulSet", docs).items():
        svc = objects("Service", docs).get(sts["spec"].get("serviceName", ""))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            problems.append(f"StatefulSet {name}: serviceName is no headless Service")
    for w in workloads:
        if w["kind"] == "Pod" or "selector" not in w["spec"]:  # a Job's is made
            continue
        match = w["spec"]["selector"]["matchLabels"]
        if not match.items() <= pod_labels(w).items():
            problems.append(
                f"{w['kind']} {w['metadata']['name']}: selector misses its pods"
            )
    return problems


def _address_problems(address: str, docs: list[Doc], where: str) -> list[str]:
    host, _, port = address.rpartition(":")
    svc = objects("Service", docs).get(host.split(".")[0])
    if svc is None or int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
        return [f"{where}: no Service port for {address}"]
    return []


def _container_problems(doc: Doc, container: Doc, docs: list[Doc]) -> list[str]:
    name = f"{doc['kind']} {doc['metadata']['name']}/{container['name']}"
    spec = pod_spec(doc)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claims = {
        t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])
    }
    problems = []
    mounts = []  # (mountPath, readOnly, files or None)
    for mount in container.get("volumeMounts", []):
        if mount["name"] in claims:
            mounts.append(
                (mount["mountPath"], mount.get("readOnly", False), None, True)
            )
            continue
        volume = volumes.get(mount["name"])
        if volume is None:
            problems.append(f"{name}: mount of a missing volume {mount['name']}")
            continue
        files, found = _volume_files(volume, docs)
        problems += found
        mounts.append((mount["mountPath"], mount.get("readOnly", False), files, False))

    command = container.get("command", [])
    if not command or command[0] not in DAEMONS:
        return problems
    daemon = command[0]
    for arg in command[1:]:
        flag = arg.split("=", 1)[0]
        if not daemon_has_flag(daemon, flag):
            problems.append(f"{name}: {daemon} has no {flag}")
    for ordinal in ordinals(doc):
        args = [expand(a, ordinal) for a in command]
        for flag in PATH_FLAGS:
            value = flag_value(args, flag)
            if value is None:
                continue
            path = PurePosixPath(value)
            under = [m for m in mounts if path.is_relative_to(m[0])]
            if not under:
                problems.append(f"{name}: {flag}={value} is in no mounted volume")
                continue
            mount_path, read_only, files, _ = under[0]
            if files is not None and str(path.relative_to(mount_path)) not in files:
                problems.append(f"{name}: {flag}={value}: the volume has no such file")
            if flag == "--database" and read_only:
                problems.append(f"{name}: --database on a read-only volume")
        superlink = flag_value(args, "--superlink")
        if superlink:
            problems += _address_problems(superlink, docs, name)
        node_config = flag_value(args, "--node-config")
        if node_config is not None:
            problems += _node_config_problems(name, doc, node_config, ordinal, mounts)
    return problems


def _node_config_problems(name, doc, node_config, ordinal, mounts) -> list[str]:
    problems = []
    config = parse_config_args([node_config])
    data_path = config.get("data-path")
    own = [m for m in mounts if m[3] and m[0] == data_path]
    if not own:
        problems.append(f"{name}: data-path={data_path!r} is not its own data volume")
    elif not own[0][1]:
        problems.append(f"{name}: the data volume at {data_path} is not read-only")
    if ordinal is not None:
        if config.get("partition-id") != ordinal:
            problems.append(
                f"{name}: pod {ordinal} has partition-id {config.get('partition-id')}"
            )
        if config.get("num-partitions") != doc["spec"]["replicas"]:
            problems.append(f"{name}: num-partitions is not replicas")
    return problems


def _cli_problems(docs: list[Doc]) -> list[str]:
    """The in-cluster CLI connection reaches the SuperLink's Service with the CA."""
    problems = []
    for cm in objects("ConfigMap", docs).values():
        text = cm.get("data", {}).get("config.toml")
        if not text or text == "x":
            continue
        config = tomllib.loads(text)["superlink"]
        connection = config[config["default"]]
        problems += _address_problems(connection["address"], docs, "flwr config.toml")
        ca = PurePosixPath(connection["root-certificates"])
        users = [
            w for w in docs if w["kind"] in WORKLOADS
            for v in pod_spec(w).get("volumes", [])
            if v.get("configMap", {}).get("name") == cm["metadata"]["name"]
        ]  # fmt: skip
        for w in users:
            for c in pod_spec(w)["containers"]:
                provided = []
                for m in c.get("volumeMounts", []):
                    volume = {v["name"]: v for v in pod_spec(w)["volumes"]}.get(
                        m["name"]
                    )
                    files = _volume_files(volume, docs)[0] if volume else None
                    if files and ca.is_relative_to(m["mountPath"]):
                        provided.append(str(ca.relative_to(m["mountPath"])) in files)
                if not any(provided):
                    problems.append(f"{w['metadata']['name']}: no {ca} mounted")
    return problems


def cross_problems(docs: list[Doc]) -> list[str]:
    problems = _service_problems(docs) + _cli_problems(docs)
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for container in pod_spec(doc)["containers"]:
                problems += _container_problems(doc, container, docs)
            for volume in pod_spec(doc).get("volumes", []):
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim not in objects("PersistentVolumeClaim", docs):
                    # a StatefulSet's PVC: <template>-<statefulset>-<ordinal>
                    made = {
                        f"{t['metadata']['name']}-{s}-{k}"
                        for s, sts in objects("StatefulSet", docs).items()
                        for t in sts["spec"]["volumeClaimTemplates"]
                        for k in range(sts["spec"]["replicas"])
                    }
                    if claim not in made:
                        problems.append(f"{doc['metadata']['name']}: no PVC {claim}")
    return problems


def all_docs() -> list[Doc]:
    return manifests() + generated(kustomization())


# -- the tests ------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    docs = all_docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "StatefulSet", "Secret", "Job"} <= kinds
    assert schema_problems(docs, version) == []


def test_names_ports_secrets_mounts_and_flags_agree():
    assert cross_problems(all_docs()) == []


def test_supernodes_each_get_their_own_ordinal_key_and_data():
    """What the StatefulSet means for pod k, spelled out."""
    docs = all_docs()
    sts = objects("StatefulSet", docs)["supernode"]
    (container,) = pod_spec(sts)["containers"]
    (env,) = container["env"]
    assert env["name"] == "POD_INDEX"
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    for k in range(sts["spec"]["replicas"]):
        args = [expand(a, k) for a in container["command"]]
        assert (
            flag_value(args, "--auth-supernode-private-key")
            == f"/keys/supernode-{k}.key"
        )
        assert parse_config_args([flag_value(args, "--node-config")]) == {
            "partition-id": k,
            "num-partitions": 3,
            "data-path": "/data",
        }
    # the SuperLink pod mounts no data of the nodes, only state, results, certs
    superlink = pod_spec(objects("Deployment", docs)["superlink"])
    volumes = superlink["volumes"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in volumes
        if "persistentVolumeClaim" in v
    }
    assert claims == {"superlink-state", "fedadapt-results"}
    # the SuperNodes never see the server's key, nor the SuperLink the nodes' keys
    node_secrets = {v["secret"]["secretName"] for v in pod_spec(sts)["volumes"]}
    assert node_secrets == {"fedadapt-ca", "supernode-keys"}
    link_secrets = {
        source["secret"]["name"]
        for v in volumes
        if "projected" in v
        for source in v["projected"]["sources"]
    }
    assert link_secrets == {"fedadapt-ca", "superlink-tls"}


def test_kustomization_lists_every_manifest_and_files_fedadapt_writes(tmp_path):
    from fedadapt.tools.deploy.certs import make_certificates, make_node_keys

    kustomize = kustomization()
    listed = set(kustomize["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"load-data.yaml"}  # the loader is applied by hand
    # the generators read exactly file names `fedadapt certs` / `node-keys` write
    replicas = objects("StatefulSet", manifests())["supernode"]["spec"]["replicas"]
    make_certificates(tmp_path, ["superlink"])
    make_node_keys(tmp_path, replicas)
    for field in ("secretGenerator", "configMapGenerator"):
        for gen in kustomize[field]:
            for entry in gen["files"]:
                source = PurePosixPath(entry.split("=", 1)[1])
                assert source.parts[0] == "certs", entry
                assert (tmp_path / source.name).is_file(), entry
    keys = objects("Secret", generated(kustomize))["supernode-keys"]["data"]
    assert set(keys) == {f"supernode-{k}.key" for k in range(replicas)}
    assert (ROOT / ".gitignore").read_text().count("/docker/k8s/certs/") == 1


# -- the checks fail on broken manifests ------------------------------------------


def _obj(docs: list[Doc], kind: str, name: str) -> Doc:
    return objects(kind, docs)[name]


def _superlink(docs: list[Doc]) -> Doc:
    return pod_spec(_obj(docs, "Deployment", "superlink"))["containers"][0]


def _supernode(docs: list[Doc]) -> Doc:
    return pod_spec(_obj(docs, "StatefulSet", "supernode"))["containers"][0]


def _set_arg(container: Doc, flag: str, value: str) -> None:
    command = container["command"]
    (index,) = [i for i, a in enumerate(command) if a.startswith(f"{flag}=")]
    command[index] = f"{flag}={value}"


WRONG_CLI = """
[superlink]
default = "x"
[superlink.x]
address = "superlink:9093"
root-certificates = "/certs/ca.crt"
"""

# schema errors: the manifests as kubectl would refuse them
BREAKAGES = {
    "unknown field": lambda d: _obj(d, "Deployment", "superlink")["spec"].update(
        replica=2
    ),
    "port as a string": lambda d: _superlink(d)["ports"][0].update(
        containerPort="8000"
    ),
}
# errors the schemas accept and a cluster would only show at run time
CROSS_BREAKAGES = {
    "selector matches no pod": lambda d: _obj(d, "Service", "superlink")["spec"][
        "selector"
    ].update({"app.kubernetes.io/name": "super-link"}),
    "unknown target port": lambda d: _obj(d, "Service", "superlink")["spec"]["ports"][
        0
    ].update(targetPort="fleet"),
    "missing secret": lambda d: pod_spec(_obj(d, "StatefulSet", "supernode"))[
        "volumes"
    ][0]["secret"].update(secretName="fedadapt-ca-cert"),
    "key the secret lacks": lambda d: _set_arg(
        _supernode(d), "--auth-supernode-private-key", "/keys/node-$(POD_INDEX).key"
    ),
    "more pods than keys": lambda d: _obj(d, "StatefulSet", "supernode")["spec"].update(
        replicas=4
    ),
    "certificate outside its mount": lambda d: _set_arg(
        _superlink(d), "--ssl-ca-certfile", "/etc/ca.crt"
    ),
    "unknown flag": lambda d: _supernode(d)["command"].append("--data-path=/data"),
    "data-path not the data volume": lambda d: _set_arg(
        _supernode(d), "--node-config", "partition-id=$(POD_INDEX) data-path='/tmp'"
    ),
    "CLI to a wrong port": lambda d: _obj(d, "ConfigMap", "flwr-cli-config")[
        "data"
    ].update({"config.toml": WRONG_CLI}),
}


# what the problem found must say
WHY = {
    "unknown field": "'replica' was unexpected",
    "port as a string": "is not of type 'integer'",
    "selector matches no pod": "selects []",
    "unknown target port": "no container port fleet",
    "missing secret": "no Secret fedadapt-ca-cert",
    "key the secret lacks": "/keys/node-0.key: the volume has no such file",
    "more pods than keys": "/keys/supernode-3.key: the volume has no such file",
    "certificate outside its mount": "/etc/ca.crt is in no mounted volume",
    "unknown flag": "flower-supernode has no --data-path",
    "data-path not the data volume": "data-path='/tmp' is not its own data volume",
    "CLI to a wrong port": "no Service port for superlink:9093",
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_schema_check_fails_on_a_broken_manifest(breakage):
    docs = copy.deepcopy(all_docs())
    BREAKAGES[breakage](docs)
    problems = schema_problems(docs, VERSIONS[-1])
    assert any(WHY[breakage] in p for p in problems), problems


@pytest.mark.parametrize("breakage", list(CROSS_BREAKAGES))
def test_cross_check_fails_on_a_broken_manifest(breakage):
    docs = copy.deepcopy(all_docs())
    CROSS_BREAKAGES[breakage](docs)
    problems = cross_problems(docs)
    assert any(WHY[breakage] in p for p in problems), problems


# -- what kustomize renders -------------------------------------------------------


def test_kustomize_output_is_valid_and_consistent(tmp_path):
    """``kubectl kustomize`` with real certificates and keys: both checks pass."""
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl (its built-in kustomize renders the kustomization)")
    from fedadapt.tools.deploy.certs import make_certificates, make_node_keys

    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    make_certificates(folder / "certs", ["superlink", "superlink.fedadapt.svc"])
    make_node_keys(folder / "certs", 3)
    done = subprocess.run(
        ["kubectl", "kustomize", str(folder)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert {
        d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"
    } == {"fedadapt"}
    assert schema_problems(docs, VERSIONS[-1]) == []
    assert cross_problems(docs) == []
    # the Secrets hold the files fedadapt wrote, under the names the pods use
    secret = objects("Secret", docs)["supernode-keys"]["data"]
    written = (folder / "certs" / "supernode-2.key").read_bytes()
    assert base64.b64decode(secret["supernode-1.key"]) == written
    tls = objects("Secret", docs)["superlink-tls"]
    assert tls["type"] == "kubernetes.io/tls"
    assert (
        base64.b64decode(tls["data"]["tls.key"])
        == (folder / "certs" / "server.key").read_bytes()
    )
    ca = objects("Secret", docs)["fedadapt-ca"]["data"]["ca.crt"]
    assert base64.b64decode(ca) == (folder / "certs" / "ca.crt").read_bytes()
