"""Each SuperNode with its own data, the server with none, in real containers (#31).

docker/compose.nodedata.yaml under a compose project of its own: three
SuperNodes, each mounting only its own folder of ``project.node_data``
(read-only at /data, ``data-path='/data'`` in its node config), and a
SuperLink (which runs the ServerApp) with no dataset. The fixture writes three
disjoint shards of scikit-learn's digits, the digits-mlp task's shape
(``x``: float32 (n, 64) in [0, 1], ``y``: int64 in 0..9), as ``data.npz``.

NEEDS #31 items 1 and 3 (the ClientApp reading data-path, central evaluation
off): until both are merged the run below trains on the shared digits by
partition-id, and the central-evaluation switch is a placeholder
(``CENTRAL_EVAL_OFF``). The container checks (who mounts what, read-only)
hold already.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedadapt.tools.submission import submit_run
from tests.helpers import ROOT

pytestmark = pytest.mark.docker

NODES = ["supernode-1", "supernode-2", "supernode-3"]
# PLACEHOLDER (#31 item 3): the run-config key that turns central evaluation off
CENTRAL_EVAL_OFF: dict = {}
RUN = {
    "task": "digits-mlp",
    "strategy": "feddua",
    "clients-per-round": 3,
    "clients-per-eval": 3,  # federated evaluation on each node's held-out split
    "local-steps": 5,
    "num-server-rounds": 2,
    "output-dir": "/results",
    **CENTRAL_EVAL_OFF,
}


def write_node_data(root, nodes=NODES, seed=0) -> list[np.ndarray]:
    """Write one disjoint digits shard per node as ``<root>/<node>/data.npz``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    shards = np.array_split(order, len(nodes))
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    for node, rows in zip(nodes, shards, strict=True):
        folder = root / node
        folder.mkdir()
        np.savez(folder / "data.npz", x=x[rows], y=y[rows])
        folder.chmod(0o755)  # the containers run as uid 1000
        (folder / "data.npz").chmod(0o644)
    return shards


def _exec(project, service: str, *command: str) -> tuple[int, str]:
    import subprocess

    done = subprocess.run(
        ["docker", "exec", project.container(service), *command],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_compose_nodes_own_data_server_none(project):
    project.files[:] = [ROOT / "docker" / "compose.nodedata.yaml"]
    shards = write_node_data(project.node_data)
    project("up", "-d")
    connection = project.connection()
    project.wait_online(connection, 3)

    # the ServerApp's container has no dataset; each node only its own, read-only
    code, out = _exec(project, "superlink", "ls", "/datasets")
    assert code != 0, out
    for node, rows in zip(NODES, shards, strict=True):
        code, out = _exec(
            project, node, "python3", "-c",
            "import numpy as np; print(len(np.load('/data/data.npz')['y']))",
        )  # fmt: skip
        assert (code, out.split()) == (0, [str(len(rows))]), out
        code, out = _exec(project, node, "touch", "/data/written")
        assert code != 0, f"{node}: /data is writable"
        code, out = _exec(project, node, "ls", "/datasets")
        assert code != 0, out

    outcome = submit_run(connection, ROOT, RUN, 3, 500, results_dir=project.results)
    assert outcome.ok, (outcome.status, outcome.details, outcome.problems)
    data = json.loads(outcome.results.read_text())
    assert data["status"] == "completed"
    rounds = data["rounds"]
    assert all(r["replies"]["used"] == 3 for r in rounds)
    # it learns, judged on the nodes' own held-out data
    first, last = rounds[0]["federated_eval"], rounds[-1]["federated_eval"]
    assert last["eval-loss"] < first["eval-loss"]
