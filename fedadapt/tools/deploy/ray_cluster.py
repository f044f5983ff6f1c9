"""Ray clusters for a suite: started once, shared by its cells (#39).

Flower's simulation runtime starts a private Ray instance for every run
unless ``RAY_ADDRESS`` names a cluster (docs/ray-cluster.md). A suite of 8–40
cells used to pay that start-up (and Ray's races on a busy machine) once per
cell; :class:`PrivateRayCluster` starts a head node on a loopback address
that several cells use one after another, and stops exactly what it started
(never ``ray stop``, which stops every Ray process on the machine).

Why one cell at a time per cluster: Flower sizes a run's actor pool from
the cluster's *total* resources (``pool_size_from_resources``: Σ over nodes
of ⌊node CPUs / client CPUs⌋), not from what is free, and a job sent to an
actor that Ray cannot place yet waits for it. Two runs on one cluster each
build a pool for the whole of it; started together, each can hold part of
it and wait for the rest — a round that never ends. So a suite that runs S
cells at once runs S *slots*: S private clusters, each with 1/S of the
CPUs, each running its cells in turn (:func:`suite_slots`). Clients that
share GPUs: every slot's node declares the machine's GPUs and each client's
GPU share is scaled by S (:func:`slot_federation_config`), so the S slots'
pools together fit the GPUs.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from fedadapt.tools.deploy.process import (
    ProcessTree,
    flower_env,
    free_port,
    program,
    raise_if_left,
    signals_deferred,
)

#: Ray rewrites 127.0.0.1 and ``localhost`` to the machine's interface
#: address; another loopback address keeps the cluster on loopback.
RAY_HOST = "127.0.0.2"

#: Flower's defaults for the resources of one simulated client.
FLOWER_CLIENT_CPUS = 2.0
FLOWER_CLIENT_GPUS = 0.0

#: Seconds Ray's daemons get after SIGTERM before SIGKILL.
STOP_GRACE_S = 2.0

CLIENT_CPUS = "client-resources-num-cpus"
CLIENT_GPUS = "client-resources-num-gpus"
INIT_CPUS = "init-args-num-cpus"
INIT_GPUS = "init-args-num-gpus"


def parse_federation_config(text: str) -> dict[str, str]:
    """``"k=v k=v"`` (``flwr run --federation-config``) as an ordered dict."""
    items: dict[str, str] = {}
    for part in text.split():
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"federation config: {part!r} is not KEY=VALUE")
        items[key] = value
    return items


def format_federation_config(items: dict[str, str]) -> str:
    """Write ``items`` back as ``"k=v k=v"`` (see :func:`parse_federation_config`)."""
    return " ".join(f"{k}={v}" for k, v in items.items())


def _number(items: dict[str, str], key: str, default: float) -> float:
    try:
        value = float(items.get(key, default))
    except ValueError as error:
        raise ValueError(f"federation config: {key} must be a number") from error
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"federation config: {key} must be ≥ 0, got {value}")
    return value


def client_resources(federation_config: str) -> tuple[float, float]:
    """(CPUs, GPUs) one simulated client reserves under ``federation_config``."""
    items = parse_federation_config(federation_config)
    cpus = _number(items, CLIENT_CPUS, FLOWER_CLIENT_CPUS)
    if cpus <= 0:
        raise ValueError(f"federation config: {CLIENT_CPUS} must be > 0")
    return cpus, _number(items, CLIENT_GPUS, FLOWER_CLIENT_GPUS)


#: CPUs a suite's simulated client reserves unless its federation config
#: says otherwise (Flower's default is 2). Measured on the 2-core VM,
#: 2026-11-28: the Δ-SGD cell of conf/delta-sgd-fedprox-mnist5k.yaml took
#: 3.3 s a round with Flower's default (one actor, two torch threads) and
#: 2.0 s with one CPU a client (two one-thread actors); a small model's
#: steps do not divide over threads, the clients do over actors.
SUITE_CLIENT_CPUS = 1


def suite_federation_config(federation_config: str) -> str:
    """``federation_config`` with a suite's client CPUs filled in.

    :data:`SUITE_CLIENT_CPUS` where it names none; a value the user gave is
    kept. ``fedadapt simulate`` fills it in the same way.
    """
    items = parse_federation_config(federation_config)
    items.setdefault(CLIENT_CPUS, _plain(SUITE_CLIENT_CPUS))
    return format_federation_config(items)


#: Slots a suite runs without ``--parallel``: one per this many CPUs (a slot
#: is a Ray head, a SuperLink and a ServerApp besides its clients: on 2 cores
#: two slots starved each other's heartbeats), at most AUTO_SLOTS_MAX.
AUTO_CPUS_PER_SLOT = 4
AUTO_SLOTS_MAX = 4


def suite_slots(
    requested: int | None,
    cells: int,
    cpus: float,
    gpus: float,
    client: tuple[float, float],
) -> int:
    """How many cells a suite runs at once (slots, each its own cluster).

    Bounded by ``requested`` (``--parallel``; None: one slot per
    :data:`AUTO_CPUS_PER_SLOT` CPUs, at most :data:`AUTO_SLOTS_MAX`)
    and by the number of cells. Each slot gets ⌊CPUs / S⌋ CPUs, which must
    hold one client (c CPUs); with GPU clients the scaled share S·g must fit
    the GPUs and be at most one GPU or a whole number of them (Ray's rule for
    fractional GPUs). At least 1: a machine too small for even one client is
    Flower's error to report (an empty actor pool).
    """
    client_cpus, client_gpus = client
    auto = max(1, min(AUTO_SLOTS_MAX, int(cpus // AUTO_CPUS_PER_SLOT)))
    bound = requested if requested is not None else auto
    best = 1
    for slots in range(1, max(1, min(cells, bound)) + 1):
        fits = (cpus // slots) >= client_cpus
        if client_gpus > 0:
            share = slots * client_gpus
            fits = fits and share <= gpus and (share <= 1 or share.is_integer())
        if fits:
            best = slots
    return best


#: Ray's default range for the ports its workers and drivers bind.
RAY_WORKER_PORTS = (10002, 19999)


def worker_port_ranges(clusters: int) -> list[tuple[int, int]]:
    """Split Ray's worker port range into ``clusters`` disjoint ranges.

    Every Ray node binds each new worker's (and each driver's) gRPC server
    to a port of its range, starting from the bottom, and does not retry
    on a port another node on the machine holds: with two private clusters
    on one machine, a ServerApp's driver died with "Failed to start the grpc
    server. The specified port is 10002" (Ray 2.55), and its cell failed
    with Flower's "No heartbeat received from the task". Slot ``i`` gets the
    ``i``-th of ``clusters`` equal parts (a part holds hundreds of ports; a
    cluster needs one per worker and driver).
    """
    if clusters < 1:
        raise ValueError(f"worker_port_ranges: clusters must be >= 1, got {clusters}")
    first, last = RAY_WORKER_PORTS
    width = (last - first + 1) // clusters
    return [(first + i * width, first + (i + 1) * width - 1) for i in range(clusters)]


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def slot_federation_config(federation_config: str, slots: int) -> str:
    """Each cell's ``--federation-config`` when the suite runs ``slots`` slots.

    ``init-args-*`` are dropped: Ray refuses resource arguments when a run
    joins a running cluster (the clusters were sized when started). A GPU
    client's share is scaled by ``slots`` (module docstring).
    """
    items = parse_federation_config(federation_config)
    _, gpus = client_resources(federation_config)
    items.pop(INIT_CPUS, None)
    items.pop(INIT_GPUS, None)
    if slots > 1 and gpus > 0:
        items[CLIENT_GPUS] = _plain(gpus * slots)
    return format_federation_config(items)


class PrivateRayCluster:
    """A one-node Ray cluster on loopback for one command, stopped on exit.

    ``ray start --head`` runs with a marked environment (:class:`ProcessTree`):
    the GCS, raylet, agents and every worker carry the mark, so leaving the
    ``with`` block stops exactly them, whatever else runs Ray on the machine.
    Its temp dir is its own (a short path: Ray's Unix sockets have a 108-byte
    limit), so other simulations on the machine do not join it.

    ``num_cpus`` defaults to the machine's cores; ``num_gpus`` to what Ray
    detects. ``name`` names its log (``<log_dir>/<name>.log``); ``host`` is
    its loopback address (one per cluster on a machine). ``worker_ports``
    (first, last) is the range its workers and drivers bind (Ray's default,
    10002–19999, when None): clusters started side by side need disjoint
    ranges (:func:`worker_port_ranges`).
    """

    def __init__(
        self,
        log_dir: Path,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        name: str = "ray-head",
        host: str = RAY_HOST,
        worker_ports: tuple[int, int] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.worker_ports = worker_ports
        self.num_cpus = num_cpus if num_cpus is not None else float(os.cpu_count() or 1)
        self.num_gpus = num_gpus
        self.name = name
        self.host = host
        self.tree = ProcessTree()
        self.port = 0
        self.temp_dir: Path | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the head (what ``RAY_ADDRESS`` takes)."""
        return f"{self.host}:{self.port}"

    def __enter__(self) -> PrivateRayCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="fa-ray-", dir="/tmp"))
        self.port = free_port()
        command = [
            program("ray"),
            "start",
            "--head",
            f"--node-ip-address={self.host}",
            f"--port={self.port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--num-cpus={_plain(self.num_cpus)}",
            "--disable-usage-stats",
            "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}",
        ]
        if self.num_gpus is not None:
            command.append(f"--num-gpus={_plain(self.num_gpus)}")
        if self.worker_ports is not None:
            first, last = self.worker_ports
            command += [f"--min-worker-port={first}", f"--max-worker-port={last}"]
        env = flower_env(self.log_dir, RAY_USAGE_STATS_ENABLED="0")
        log_path = self.log_dir / f"{self.name}.log"
        try:
            with log_path.open("ab") as log_file:
                done = subprocess.run(
                    command,
                    env=self.tree.env(env),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    timeout=180,
                )
            if done.returncode != 0:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(
                    f"ray start --head failed ({done.returncode}): "
                    + " | ".join(tail)
                    + f"; see {log_path}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process of the cluster; verify none is left."""
        with signals_deferred():
            # Ray's daemons keep no state worth a long grace; the GCS often
            # waits out a SIGTERM, so SIGKILL follows soon
            left = self.tree.stop(grace=STOP_GRACE_S)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
        raise_if_left(left)
