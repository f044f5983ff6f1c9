"""Helpers shared by the tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from unittest.mock import Mock

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

ROOT = Path(__file__).resolve().parents[1]

#: fedadapt's default defences off (issue #38: norm clipping at 2x the
#: median, the weight cap, the pull cap, the norm ceiling, the opposing
#: projection, the step guard, the rule's robust aggregator), for tests
#: whose oracle is the bare rule (Flower's strategies, a formula written in
#: the test)
NO_DEFENCE = {
    "aggregation": "mean",
    "max_update_norm_ratio": 0.0,
    "max_weight_ratio": 0.0,
    "max_contribution_ratio": 0.0,
    "max_update_norm_growth": 0.0,
    "project_opposing": False,
    "step_guard": False,
}
VENV_BIN = Path(sys.executable).parent


def guard_a(weights, sq_norms, leave_out=()):
    """The step guard's A, brute force: the largest A of one client less.

    A over ``sq_norms`` without the clients ``leave_out`` (weights
    renormalised over the rest), maximised over one more client left out;
    with fewer than 4 clients left, the plain A (the guard leaves it).
    """
    rest = [i for i in range(len(sq_norms)) if i not in leave_out]

    def plain(kept):
        total = sum(weights[i] for i in kept)
        return sum(weights[i] * sq_norms[i] for i in kept) / total

    if len(sq_norms) < 4:
        return plain(rest)
    return max(plain([i for i in rest if i != j]) for j in rest)


def make_reply(
    arrays: dict[str, np.ndarray] | None,
    metrics: dict,
    node_id: int = 1,
    error: bool = False,
) -> Message:
    """A reply Message as a strategy receives it (like Flower's create_mock_reply)."""
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    message = Mock(spec=Message)
    message.content = content
    message.has_error.return_value = error
    message.metadata.src_node_id = node_id
    message.error.reason = "client raised"
    return message


class FakeSuperLink:
    """A SimulationSuperLink that starts nothing: what submit_run reads of a
    SuperLink (``SuperLinkTarget``) and a context manager, for tests that
    replace ``flwr`` too (``SimulationSuperLink`` or a ``superlink``
    argument)."""

    def __init__(self, flwr_home: Path, *args: object, **kwargs: object) -> None:
        self.flwr_home = flwr_home
        self.address = "127.0.0.1:1"
        self.connection = "fake"
        self.root_certificates: Path | None = None
        self.simulation = True

    def __enter__(self) -> FakeSuperLink:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeRayCluster:
    """A PrivateRayCluster that starts nothing; ``started`` counts entries."""

    started = 0

    def __init__(self, log_dir: Path, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.address = "127.0.0.2:1"

    def __enter__(self) -> FakeRayCluster:
        type(self).started += 1
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fake_ray(monkeypatch, cpus: int = 2, gpus: int = 0) -> type[FakeRayCluster]:
    """Make suites run on fake clusters, on a machine of ``cpus`` and ``gpus``."""
    from fedadapt.tools import experiments
    from fedadapt.tools.deploy import ray_cluster

    cluster = type("Cluster", (FakeRayCluster,), {"started": 0})
    monkeypatch.setattr(ray_cluster, "PrivateRayCluster", cluster)
    monkeypatch.setattr(experiments.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(experiments, "_visible_gpus", lambda: gpus)
    return cluster


BACKEND_CONFIG = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False},
}


def run_in_process(
    overrides: dict,
    num_supernodes: int = 3,
    server_main=None,
    client_train=None,
    client_evaluate=None,
    client_query=None,
    node_config=None,
) -> None:
    """Run Message-API apps with flwr's in-process ``run_simulation``.

    ``run_simulation`` ignores pyproject.toml (empty run config), and the
    ClientApp's context may not be mutated (flwr 1.41 raises ``ValueError``),
    so both apps are wrapped and fed ``overrides`` as the run config. The apps
    default to fedadapt's own; pass another app's functions to run it the same
    way. ``node_config`` maps a node's simulated node config (with its
    ``partition-id``) to the one its ClientApp sees (e.g. a ``data-path``).
    """
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedadapt.client import client_app
    from fedadapt.server import server_app

    server_main = server_main or server_app.main
    client_train = client_train or client_app.train
    client_evaluate = client_evaluate or client_app.evaluate
    client_query = client_query or client_app.query
    run_config = dict(overrides)
    server = ServerApp()

    @server.main()
    def _main(grid, context):
        context.run_config.clear()
        context.run_config.update(run_config)
        server_main(grid, context)

    def _ctx(c: Context) -> Context:
        nodes = c.node_config if node_config is None else node_config(c.node_config)
        return Context(c.run_id, c.node_id, nodes, c.state, dict(run_config))

    client = ClientApp()

    @client.train()
    def _train(msg, context):
        return client_train(msg, _ctx(context))

    @client.evaluate()
    def _evaluate(msg, context):
        return client_evaluate(msg, _ctx(context))

    @client.query()
    def _query(msg, context):
        return client_query(msg, _ctx(context))

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=num_supernodes,
        backend_config=BACKEND_CONFIG,
    )


def run_legacy_in_process(overrides: dict, num_supernodes: int = 3) -> None:
    """Run the legacy ServerApp + NumPyClient with ``run_simulation``."""
    from flwr.app import Context
    from flwr.client import ClientApp
    from flwr.simulation import run_simulation

    from fedadapt.client import numpy_client
    from fedadapt.server import legacy_app

    run_config = dict(overrides)

    def server_fn(context: Context):
        context.run_config.clear()
        context.run_config.update(run_config)
        return legacy_app.server_fn(context)

    def client_fn(c: Context):
        return numpy_client.client_fn(
            Context(c.run_id, c.node_id, c.node_config, c.state, dict(run_config))
        )

    run_simulation(
        server_app=legacy_app.make_app(server_fn),
        client_app=ClientApp(client_fn=client_fn, mods=numpy_client.MODS),
        num_supernodes=num_supernodes,
        backend_config=BACKEND_CONFIG,
    )


def processes_under(root: Path) -> list[str]:
    """Command lines of live processes whose FLWR_HOME is ``root`` or inside it."""
    return list(pids_under(root).values())


def pids_under(root: Path) -> dict[int, str]:
    """PID -> command line of live processes whose FLWR_HOME is ``root`` or inside."""
    prefix = f"FLWR_HOME={root}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if any(v == prefix or v.startswith(prefix + b"/") for v in environ):
                found[int(proc.name)] = (
                    (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except OSError:
            continue
    return found


def stop_processes_under(root: Path) -> None:
    """SIGTERM (then SIGKILL) every process started with FLWR_HOME under ``root``.

    For what Flower starts detached, e.g. the ``:local:`` SuperLink.
    """
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_under(root):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while pids_under(root) and time.monotonic() < deadline:
            time.sleep(0.2)


def assert_no_processes_under(root: Path, wait: float = 20.0) -> None:
    """Fail if a process started with FLWR_HOME under ``root`` outlives ``wait``."""
    deadline = time.monotonic() + wait
    while processes_under(root) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_under(root) == [], "processes left running"


def compose_tool() -> list[str] | None:
    """The installed compose command (v2 plugin or v1), or None."""
    if shutil.which("docker"):
        v2 = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, check=False
        )
        if v2.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose_config(files: list[Path], env: dict[str, str]) -> dict:
    """Merge compose ``files`` with the installed compose tool; return the result.

    Skips the calling test where no compose tool is installed. The tool is a
    system program: it runs without this interpreter's Python path
    (conftest.py's ``keep_pythonpath``), with ``env`` added to the environment.
    """
    import pytest
    import yaml

    tool = compose_tool()
    if tool is None:
        pytest.skip("no docker compose / docker-compose (docker/engine.sh up)")
    command = [*tool, "-p", "fadconfig"]
    for path in files:
        command += ["-f", str(path)]
    clean = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")
    }
    done = subprocess.run(
        [*command, "config"],
        capture_output=True,
        text=True,
        env={**clean, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@cache
def daemon_help(daemon: str) -> str:
    """``--help`` of an installed Flower daemon (flower-superlink, ...)."""
    done = subprocess.run(
        [str(VENV_BIN / daemon), "--help"], capture_output=True, text=True, check=True
    )
    return done.stdout


def daemon_has_flag(daemon: str, flag: str) -> bool:
    """Whether the installed daemon's ``--help`` lists ``flag``."""
    text = daemon_help(daemon)
    return f"{flag} " in text or f"{flag}\n" in text
