"""A real deployment on this host: one SuperLink and N SuperNodes as processes.

``LocalDeployment`` starts ``flower-superlink`` (state in a SQLite database,
optionally TLS and SuperNode authentication) and ``flower-supernode``
processes on loopback, each SuperNode with its partition through
``--node-config "partition-id=<i> num-partitions=<N>"`` or, given
``data_paths``, with its own data through ``--node-config 'data-path="<path>"'``
(``fedadapt.tasks.node_data``; the server then needs no data), waits until the
SuperLink lists every node online, and stops all of them on exit (also on
Ctrl-C and on failure). Runs are submitted with ``fedadapt.tools.submission.submit_run``
exactly as in simulation. The same commands, spread over hosts, are a
multi-host deployment (docs/deployment.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from fedadapt.tools.deploy.certs import (
    make_certificates,
    make_node_keys,
    public_key_path,
)
from fedadapt.tools.deploy.process import (
    Daemon,
    ProcessTree,
    flower_env,
    flwr,
    free_port,
    http_ok,
    online_supernodes,
    program,
    raise_if_left,
    signals_deferred,
    stop_all,
    write_connection,
)

CONNECTION = "fedadapt-deploy"
#: Which SuperNode program runs each node: see :class:`LocalDeployment`.
SUPERNODES = ("fedadapt", "flower")


def data_path_node_config(path: str | Path) -> str:
    """Return the node config ``data-path="<path>"`` for ``flower-supernode``.

    Node-config values are TOML: a path must be a quoted string
    (``data-path=/data`` is refused). JSON's string escapes are TOML basic
    string escapes, so ``json.dumps`` quotes any path. Pass it as one shell
    word: ``--node-config 'data-path="/tmp/nodes/node-0"'`` (``shlex.quote``).
    """
    return f"data-path={json.dumps(str(path))}"


class LocalDeployment:
    """SuperLink + ``num_supernodes`` SuperNodes on 127.0.0.1, as processes.

    Parameters
    ----------
    workdir : Path
        Holds per-daemon FLWR_HOMEs and logs, the SuperLink database, and,
        with ``tls``/``auth``, the generated certificates and keys.
    num_supernodes : int
        SuperNodes to start; node ``i`` gets ``partition-id=i``.
    tls : bool
        Serve the SuperLink over TLS with a CA made in ``workdir/certs``.
    auth : bool
        Enable SuperNode authentication (needs ``tls``): one key pair per
        node, registered with ``flwr supernode register`` before it starts.
    port : int, optional
        SuperLink port (default: a free one).
    data_paths : sequence of Path, optional
        One per SuperNode: node ``i`` reads its own data from
        ``data_paths[i]`` (node-config ``data-path``) instead of a partition
        of the task's data.
    supernode : {"fedadapt", "flower"}
        ``fedadapt`` (default) runs each SuperNode as ``fedadapt-supernode``
        (:mod:`fedadapt.tools.deploy.supernode`: Flower's SuperNode with a
        wait for messages that starts short after each message, and a
        SuperExec that forks each ClientApp process with Flower imported);
        ``flower`` runs Flower's ``flower-supernode`` unchanged.
    """

    simulation = False

    def __init__(
        self,
        workdir: Path,
        num_supernodes: int,
        tls: bool = False,
        auth: bool = False,
        port: int | None = None,
        data_paths: Sequence[Path] | None = None,
        supernode: str = "fedadapt",
    ) -> None:
        if supernode not in SUPERNODES:
            raise ValueError(
                f"deploy: supernode={supernode!r}; choose one of "
                f"{', '.join(SUPERNODES)}"
            )
        self.supernode_kind = supernode
        if num_supernodes < 1:
            raise ValueError(f"deploy: invalid num_supernodes={num_supernodes}")
        if data_paths is not None and len(data_paths) != num_supernodes:
            raise ValueError(
                f"deploy: {len(data_paths)} data paths for {num_supernodes} "
                "SuperNodes; give one per node"
            )
        self.data_paths = (
            None if data_paths is None else [Path(p).resolve() for p in data_paths]
        )
        if auth and not tls:
            raise ValueError("deploy: SuperNode authentication needs TLS (--tls)")
        self.workdir = workdir.resolve()
        self.num_supernodes = num_supernodes
        self.tls, self.auth = tls, auth
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.flwr_home = self.workdir / "cli"
        self.connection = CONNECTION
        self.certs = self.workdir / "certs"
        self.root_certificates = self.certs / "ca.crt" if tls else None
        self.superlink: Daemon | None = None
        self.supernodes: list[Daemon] = []
        self.node_keys: list[Path] = []
        self.tree = ProcessTree()  # everything started here, for the final stop

    # --- lifecycle -------------------------------------------------------------

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the SuperLink, register keys, start and await the SuperNodes."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            make_certificates(self.certs, ["localhost", "127.0.0.1"], force=True)
        if self.auth:
            self.node_keys = make_node_keys(self.certs, self.num_supernodes, force=True)
        write_connection(
            self.flwr_home, self.connection, self.address, self.root_certificates
        )
        self.superlink = self._superlink().start()
        scheme = "https" if self.tls else "http"
        self.superlink.wait_until(
            lambda: http_ok(
                f"{scheme}://{self.address}/health", self.root_certificates
            ),
            60,
            "healthy",
        )
        for key in self.node_keys:
            self.register(key)
        for index in range(self.num_supernodes):
            self.supernodes.append(self.supernode(index).start())
        self.superlink.wait_until(
            lambda: len(self.online_nodes()) >= self.num_supernodes,
            120,
            f"seeing {self.num_supernodes} SuperNodes online",
        )

    def stop(self) -> None:
        """Stop the SuperNodes, the SuperLink and all they started, at once.

        Every process of their tree is terminated, then killed;
        :class:`ProcessesLeftError` if any survives.
        """
        with signals_deferred():
            left = self.tree.stop()
            stop_all(self.supernodes)  # reap them (and kill a group the tree missed)
            if self.superlink is not None:
                self.superlink.stop()
        raise_if_left(left)

    # --- daemons ---------------------------------------------------------------

    def _security_flags(self) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        return [
            f"--ssl-ca-certfile={self.certs / 'ca.crt'}",
            f"--ssl-certfile={self.certs / 'server.crt'}",
            f"--ssl-keyfile={self.certs / 'server.key'}",
        ]

    def _superlink(self) -> Daemon:
        home = self.workdir / "superlink"
        command = [
            program("flower-superlink"),
            *self._security_flags(),
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--database={home / 'state.db'}",
            "--disable-runtime-dependency-installation",
        ]
        if self.auth:
            command.append("--enable-supernode-auth")
        env = self.tree.env(flower_env(home))
        return Daemon("SuperLink", command, env, home / "superlink.log")

    def supernode(self, index: int, private_key: Path | None = None) -> Daemon:
        """Build (not start) SuperNode ``index``: partition ``index`` or its data path.

        ``private_key`` overrides its authentication key (tests use an
        unregistered one).
        """
        home = self.workdir / f"supernode-{index}"
        if self.data_paths is None:
            node_config = f"partition-id={index} num-partitions={self.num_supernodes}"
        else:  # a TOML value: the path must be a quoted string
            node_config = data_path_node_config(self.data_paths[index])
        if self.supernode_kind == "fedadapt":
            start = [sys.executable, "-m", "fedadapt.tools.deploy.supernode"]
        else:
            start = [program("flower-supernode")]
        command = [
            *start,
            f"--superlink={self.address}",
            f"--port={free_port()}",
            f"--node-config={node_config}",
        ]
        if self.tls:
            command.append(f"--root-certificates={self.root_certificates}")
        else:
            command.append("--insecure")
        key = private_key or (self.node_keys[index] if self.auth else None)
        if key is not None:
            command.append(f"--auth-supernode-private-key={key}")
        env = self.tree.env(flower_env(home))
        return Daemon(f"SuperNode {index}", command, env, home / "supernode.log")

    # --- queries ---------------------------------------------------------------

    def register(self, private_key: Path) -> None:
        """Register the public key of ``private_key`` with the SuperLink."""
        flwr(
            [
                "supernode",
                "register",
                str(public_key_path(private_key)),
                self.connection,
            ],
            flower_env(self.flwr_home),
        )

    def online_nodes(self) -> list[str]:
        """Node ids the SuperLink lists as online (as ``flwr`` prints them)."""
        return online_supernodes(flower_env(self.flwr_home), self.connection) or []
