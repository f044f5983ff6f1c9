"""Container tests (``make test-docker``): engine, offline image, compose projects.

The session fixture makes a Docker engine available with docker/engine.sh
(installing Debian's docker.io where none answers, stopping afterwards only a
daemon it started), builds the base image offline (docker/build-base.sh),
links the wheels (docker/fetch-wheels.sh; cache outside the repository) and
builds the app image with them. The base image and the wheel cache are kept
between runs. Tests skip only when no engine can be installed or started.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fedadapt.cli import SuperLinkConnection
from fedadapt.deploy.process import free_port
from tests.helpers import ROOT

IMAGE = "fedadapt:cpu-test"
BASE_IMAGE = "fedadapt-base:bookworm"
TORCH_SPEC = "torch==2.13.0"  # the CPU wheel on this machine's disk
DOCKER = ROOT / "docker"


def sh(command: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run a command; fail the test with its output if it fails."""
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if done.returncode != 0:
        pytest.fail(f"{shlex.join(map(str, command))} exited {done.returncode}:\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")  # fmt: skip
    return done


@pytest.fixture(scope="session")
def engine() -> Iterator[list[str]]:
    """Yield the compose command; the engine is stopped afterwards if we started it."""
    up = subprocess.run(
        [str(DOCKER / "engine.sh"), "up"], capture_output=True, text=True, check=False
    )
    if up.returncode != 0:
        pytest.skip(f"no Docker engine could be installed or started: {up.stderr}")
    compose = subprocess.run(
        [str(DOCKER / "engine.sh"), "compose"], capture_output=True, text=True
    ).stdout.split()
    try:
        yield compose
    finally:
        subprocess.run([str(DOCKER / "engine.sh"), "down"], check=False)


@pytest.fixture(scope="session")
def image(engine) -> str:
    """Build the base image (if missing), link the wheels and build the app image."""
    started = time.monotonic()
    sh([str(DOCKER / "build-base.sh"), BASE_IMAGE])
    sh([str(DOCKER / "fetch-wheels.sh"), TORCH_SPEC])
    sh(["docker", "build", "-q", "-f", str(DOCKER / "Dockerfile"),
        "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
        "--build-arg", f"TORCH_SPEC={TORCH_SPEC}",
        "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels",
        "-t", IMAGE, str(ROOT)])  # fmt: skip
    print(f"\nimages ready in {time.monotonic() - started:.0f}s")
    return IMAGE


@dataclass
class ComposeProject:
    """One compose project of this test session, removed by ``down``."""

    compose: list[str]
    name: str
    files: list[str]
    workdir: Path
    port: int = field(default_factory=free_port)

    @property
    def results(self) -> Path:
        """Host folder mounted at /results in the SuperLink container."""
        return self.workdir / "results"

    @property
    def certs(self) -> Path:
        """Host folder with certificates and node keys (TLS variant)."""
        return self.workdir / "certs"

    def env(self) -> dict[str, str]:
        """Variables the compose files read."""
        env = {
            **os.environ,
            "FEDADAPT_IMAGE": IMAGE,
            "SUPERLINK_PORT": str(self.port),
            "FEDADAPT_RESULTS": str(self.results),
            "FEDADAPT_CERTS": str(self.certs),
            "FEDADAPT_DATA": str(self.workdir / "data"),
        }
        if os.getuid() != 0:  # run as the user who owns the files
            env |= {"FEDADAPT_UID": str(os.getuid()), "FEDADAPT_GID": str(os.getgid())}
        return env

    def __call__(self, *args: str, timeout: float = 300) -> str:
        """Run ``compose -p name -f ... <args>``; return stdout."""
        command = [*self.compose, "-p", self.name]
        for f in self.files:
            command += ["-f", str(DOCKER / f)]
        return sh([*command, *args], timeout=timeout, env=self.env()).stdout

    def connection(self, root_certificates: Path | None = None) -> SuperLinkConnection:
        """How the host's flwr CLI reaches the published SuperLink port."""
        return SuperLinkConnection(
            flwr_home=self.workdir / "flwr-home",
            address=f"127.0.0.1:{self.port}",
            connection=self.name,
            root_certificates=root_certificates,
        )

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project still present."""
        label = f"label=com.docker.compose.project={self.name}"
        found = []
        for kind in ("ps -a", "volume ls", "network ls"):
            out = subprocess.run(
                ["docker", *kind.split(), "-q", "--filter", label],
                capture_output=True, text=True, check=False,
            ).stdout.split()  # fmt: skip
            found += [f"{kind}: {x}" for x in out]
        return found


@pytest.fixture
def project(engine, image, tmp_path, request) -> Iterator[ComposeProject]:
    """A compose project named after the test; ``down -v`` and checked afterwards."""
    name = "fadtest" + "".join(c for c in request.node.name.lower() if c.isalnum())
    proj = ComposeProject(engine, name[:40], ["compose.yaml"], tmp_path)
    proj.results.mkdir()
    proj.results.chmod(0o777)  # the containers run as uid 1000
    try:
        yield proj
    finally:
        try:
            print(proj("logs", "--no-color", "--tail", "30")[-6000:])
        finally:
            proj("down", "-v", "--remove-orphans")
        assert proj.leftovers() == []
