"""docker/compose.nodedata*.yaml: each SuperNode sees only its own data (#31).

The per-node-data variant is a deployment where the server holds no data:
the SuperLink container (which runs the ServerApp) mounts no dataset, and
SuperNode ``i`` mounts only ``$FEDADAPT_NODE_DATA/node-<i-1>``, read-only,
at the ``data-path`` its node config names. Checked on the files as written
and on what the installed compose tool makes of every combination of
overrides (skipped where no compose tool is installed). Node configs are read
back with Flower's own parser (``flower-supernode --node-config`` values are
TOML: an unquoted path would not parse).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from flwr.common.config import parse_config_args

from tests.helpers import ROOT, compose_config

DOCKER = ROOT / "docker"
NODEDATA = DOCKER / "compose.nodedata.yaml"
NODES = ["supernode-1", "supernode-2", "supernode-3"]
# SuperNode i's host folder: what `fedadapt make-node-data` writes for node i-1
FOLDERS = {name: f"node-{i}" for i, name in enumerate(NODES)}
DATA_PATH = "/data"


def _services(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())["services"]


def _node_config(command: list[str]) -> dict:
    (arg,) = [a for a in command if a.startswith("--node-config=")]
    return parse_config_args([arg.removeprefix("--node-config=")])


def _mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each of a merged service's volumes."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            found.append((source, target, mode == ["ro"]))
        else:
            found.append(
                (volume["source"], volume["target"], bool(volume.get("read_only")))
            )
    return found


def test_each_node_mounts_only_its_own_data_and_the_superlink_none():
    services = _services("compose.nodedata.yaml")
    assert set(services) == {"superlink", *NODES}
    # the SuperLink: its state volume and the results folder, nothing else
    assert services["superlink"]["volumes"] == [
        "superlink-state:/data",
        "${FEDADAPT_RESULTS:-../results}:/results",
    ]
    for name in NODES:
        assert services[name]["volumes"] == [
            f"${{FEDADAPT_NODE_DATA:-../node-data}}/{FOLDERS[name]}:{DATA_PATH}:ro"
        ]


@pytest.mark.parametrize("file", ["compose.nodedata.yaml", "compose.nodedata.tls.yaml"])
def test_node_configs_name_the_mounted_data_and_distinct_partitions(file):
    services = _services(file)
    configs = [_node_config(services[name]["command"]) for name in NODES]
    assert [c["data-path"] for c in configs] == [DATA_PATH] * 3
    # seeded sampling orders the nodes by partition-id: distinct, 0..N-1
    assert sorted(c["partition-id"] for c in configs) == [0, 1, 2]
    assert {c["num-partitions"] for c in configs} == {3}


def test_nodedata_tls_override_is_compose_tls_with_the_data_path():
    """compose.nodedata.tls.yaml = compose.tls.yaml's commands + data-path."""
    tls = _services("compose.tls.yaml")
    override = _services("compose.nodedata.tls.yaml")
    assert set(override) == set(NODES)
    for name in NODES:
        theirs, ours = tls[name]["command"], override[name]["command"]
        strip = lambda cmd: [a for a in cmd if not a.startswith("--node-config=")]  # noqa: E731
        assert strip(ours) == strip(theirs)
        expected = {**_node_config(theirs), "data-path": DATA_PATH}
        assert _node_config(ours) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["compose.tls.yaml", "compose.nodedata.tls.yaml"],
        ["compose.gpu.yaml"],
        ["compose.tls.yaml", "compose.nodedata.tls.yaml", "compose.gpu.yaml"],
    ],
    ids=["plain", "tls", "gpu", "tls+gpu"],
)
def test_merged_nodedata_variants_isolate_the_nodes_data(overrides, tmp_path: Path):
    node_data, shared = tmp_path / "node-data", tmp_path / "shared-data"
    env = {
        "FEDADAPT_CERTS": str(tmp_path / "certs"),
        "FEDADAPT_NODE_DATA": str(node_data),
        # the shared-dataset variable of compose.yaml must reach no container
        "FEDADAPT_DATA": str(shared),
    }
    files = [NODEDATA, *(DOCKER / name for name in overrides)]
    merged = compose_config(files, env)["services"]
    assert set(merged) == {"superlink", *NODES}
    for name, service in merged.items():
        mounts = _mounts(service)
        assert not any(str(shared) in source for source, _, _ in mounts), name
        data = [m for m in mounts if str(node_data) in m[0]]
        if name == "superlink":
            assert data == [], "the SuperLink (ServerApp) must mount no node data"
            continue
        assert data == [(str(node_data / FOLDERS[name]), DATA_PATH, True)], name
        config = _node_config(service["command"])
        assert config["data-path"] == DATA_PATH
        if "compose.tls.yaml" in overrides:
            assert "--insecure" not in service["command"]
            keys = [m for m in mounts if m[1] == "/certs/supernode.key"]
            assert keys == [(str(tmp_path / "certs" / f"{name}.key"), keys[0][1], True)]
