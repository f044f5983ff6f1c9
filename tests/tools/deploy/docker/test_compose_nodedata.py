"""Each SuperNode with its own data, the server with none, in real containers (#31).

docker/compose.nodedata.yaml under a compose project of its own: three
SuperNodes, each mounting only its own folder of ``project.node_data``
(``node-<i>``, read-only at /data, ``data-path='/data'`` in its node config),
and a SuperLink (which runs the ServerApp) with no dataset and central
evaluation off (``evaluate-every=0``). The fixture writes three disjoint
shards of scikit-learn's digits in the digits-mlp task's shape (``x``:
float32 (n, 64) in [0, 1], ``y``: int64 in 0..9) as ``node-<i>/data.npz``,
the layout ``fedadapt make-node-data`` writes. The run must learn, judged by
federated evaluation on the nodes' own held-out data.

Before #31 item 1 (the ClientApp reading data-path) is merged, the nodes
ignore data-path and train on their partition-id's share of the digits; the
container checks (who mounts what, read-only) hold either way. The ClientApp
must read ``/data`` as a folder holding ``data.npz`` (see the lead's merge
notes).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT

pytestmark = pytest.mark.docker

NODES = ["supernode-1", "supernode-2", "supernode-3"]
RUN = {
    "task": "digits-mlp",
    "strategy": "feddua",
    "clients-per-round": 3,
    "clients-per-eval": 3,  # federated evaluation on each node's held-out split
    "local-steps": 5,
    "num-server-rounds": 2,
    "output-dir": "/results",
    "evaluate-every": 0,  # the server has no data: no central evaluation
}


def write_node_data(root, nodes=3, seed=0) -> list[np.ndarray]:
    """Write one disjoint digits shard per node as ``<root>/node-<i>/data.npz``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    shards = np.array_split(order, nodes)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    for i, rows in enumerate(shards):
        folder = root / f"node-{i}"
        folder.mkdir()
        np.savez(folder / "data.npz", x=x[rows], y=y[rows])
        folder.chmod(0o755)  # the containers run as uid 1000
        (folder / "data.npz").chmod(0o644)
    return shards


def _exec(project, service: str, *command: str) -> tuple[int, str]:
    done = subprocess.run(
        ["docker", "exec", project.container(service), *command],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def _mounts(project, service: str) -> list[dict]:
    """The container's mounts as the engine reports them (Source, Destination, RW)."""
    done = subprocess.run(
        [
            "docker",
            "inspect",
            "--format",
            "{{json .Mounts}}",
            project.container(service),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def test_compose_nodes_own_data_server_none(project):
    project.files[:] = [ROOT / "docker" / "compose.nodedata.yaml"]
    shards = write_node_data(project.node_data)
    project("up", "-d")
    connection = project.connection()
    project.wait_online(connection, 3)

    # the ServerApp's container: its state volume and /results, no data at all
    superlink = _mounts(project, "superlink")
    assert sorted(m["Destination"] for m in superlink) == ["/data", "/results"]
    assert not any(str(project.node_data) in m["Source"] for m in superlink)
    for i, (node, rows) in enumerate(zip(NODES, shards, strict=True)):
        # each node: only its own folder, read-only, at /data
        data = [
            m for m in _mounts(project, node) if str(project.node_data) in m["Source"]
        ]
        assert [(m["Source"], m["Destination"], m["RW"]) for m in data] == [
            (str(project.node_data / f"node-{i}"), "/data", False)
        ]
        code, out = _exec(
            project, node, "python3", "-c",
            "import numpy as np; print(len(np.load('/data/data.npz')['y']))",
        )  # fmt: skip
        assert (code, out.split()) == (0, [str(len(rows))]), out
        code, out = _exec(project, node, "touch", "/data/written")
        assert code != 0, f"{node}: /data is writable"

    outcome = submit_run(connection, ROOT, RUN, 3, 500, results_dir=project.results)
    assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
    data = json.loads(outcome.results.read_text())
    assert data["status"] == "completed"
    # the server evaluated nothing itself; the numbers are the nodes' own
    assert data["evaluation"]["central"] == {"source": "off"}
    assert data["evaluation"]["federated"]["source"] == "node-held-out"
    rounds = data["rounds"]
    assert all(r["replies"]["used"] == 3 for r in rounds)
    # it learns, judged on the nodes' own held-out data
    first, last = rounds[0]["federated_eval"], rounds[-1]["federated_eval"]
    assert last["eval-loss"] < first["eval-loss"]
