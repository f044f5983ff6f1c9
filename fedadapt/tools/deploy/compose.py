"""Drive docker/compose.yaml from Python: one compose project, its connection.

Used by the container tests and the deployment benchmark. ``ComposeProject``
runs ``docker compose`` (or ``docker-compose``) with a project name, the
compose files and the variables they read, and describes how the host's
``flwr`` CLI reaches the published SuperLink port.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedadapt.tools.deploy.process import (
    SuperLinkConnection,
    flower_env,
    free_port,
    online_supernodes,
    write_connection,
)


@dataclass
class ComposeProject:
    """One compose project; ``down()`` removes its containers, network, volumes.

    Parameters
    ----------
    compose : list of str
        The compose command (``["docker", "compose"]`` or ``["docker-compose"]``).
    name : str
        Project name (``-p``); prefixes containers, networks and volumes.
    files : list of Path
        Compose files, base first (e.g. compose.yaml, compose.tls.yaml).
    workdir : Path
        Holds ``results/`` (mounted at /results), ``certs/``, ``data/``,
        ``node-data/`` (compose.nodedata.yaml: ``node-data/supernode-<i>`` is
        SuperNode i's own data) and the CLI's FLWR_HOME.
    image : str
        Image for every service (``FEDADAPT_IMAGE``).
    """

    compose: list[str]
    name: str
    files: list[Path]
    workdir: Path
    image: str = "fedadapt:cpu"
    port: int = field(default_factory=free_port)

    @property
    def results(self) -> Path:
        """Host folder mounted at /results in the SuperLink container."""
        return self.workdir / "results"

    @property
    def certs(self) -> Path:
        """Host folder with certificates and node keys (TLS variant)."""
        return self.workdir / "certs"

    @property
    def node_data(self) -> Path:
        """Host folder of the SuperNodes' own data (compose.nodedata.yaml)."""
        return self.workdir / "node-data"

    def env(self) -> dict[str, str]:
        """Variables the compose files read."""
        env = {
            **os.environ,
            "FEDADAPT_IMAGE": self.image,
            "SUPERLINK_PORT": str(self.port),
            "FEDADAPT_RESULTS": str(self.results),
            "FEDADAPT_CERTS": str(self.certs),
            "FEDADAPT_DATA": str(self.workdir / "data"),
            "FEDADAPT_NODE_DATA": str(self.node_data),
        }
        if os.getuid() != 0:  # run as the user who owns the files
            env |= {"FEDADAPT_UID": str(os.getuid()), "FEDADAPT_GID": str(os.getgid())}
        return env

    def __call__(self, *args: str, timeout: float = 300) -> str:
        """Run ``compose -p name -f ... <args>``; return stdout."""
        command = [*self.compose, "-p", self.name]
        for path in self.files:
            command += ["-f", str(path)]
        command += list(args)
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env(),
        )
        if done.returncode != 0:
            output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            raise RuntimeError(
                f"{shlex.join(command)} exited {done.returncode}:\n{output}"
            )
        return done.stdout

    def prepare(self) -> None:
        """Create the results folder, writable by the containers' uid 1000."""
        self.results.mkdir(parents=True, exist_ok=True)
        self.results.chmod(0o777)

    def down(self) -> None:
        """Remove the project's containers, network and volumes."""
        self("down", "-v", "--remove-orphans")

    def connection(self, root_certificates: Path | None = None) -> SuperLinkConnection:
        """How the host's flwr CLI reaches the published SuperLink port."""
        return SuperLinkConnection(
            flwr_home=self.workdir / "flwr-home",
            address=f"127.0.0.1:{self.port}",
            connection=self.name,
            root_certificates=root_certificates,
        )

    def wait_online(
        self, connection: SuperLinkConnection, count: int, timeout: float = 120
    ) -> None:
        """Wait until the SuperLink answers and lists ``count`` SuperNodes online."""
        env = flower_env(connection.flwr_home)
        write_connection(
            connection.flwr_home,
            connection.connection,
            connection.address,
            connection.root_certificates,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            online = online_supernodes(env, connection.connection)
            if online is not None and len(online) >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"{count} SuperNodes not online:\n{self('ps')}")

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project still present."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        for kind in ("ps -a", "volume ls", "network ls"):
            out = subprocess.run(
                ["docker", *kind.split(), "-q", "--filter", label],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            found += [f"{kind}: {x}" for x in out]
        return found
