"""Container tests (``make test-docker``): engine, offline image, compose projects.

The session fixtures make a Docker engine available with docker/engine.sh
(installing Debian's docker.io + docker-compose where no engine answers, and
stopping afterwards only a daemon they started), build the base image offline
(docker/build-base.sh, kept between runs), link the wheels into the build
context (docker/fetch-wheels.sh; the cache lies outside the repository and is
kept) and build the app image exactly as users do, with the local base image
and the wheels as build arguments. Tests skip only when no engine can be
installed or started. Each test gets its own compose project (unique name),
taken down with ``down -v`` afterwards and checked to leave nothing behind.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from fedadapt.tools.deploy.compose import ComposeProject
from tests.helpers import ROOT

IMAGE = "fedadapt:cpu-test"
BASE_IMAGE = "fedadapt-base:bookworm"
# the only CPU torch wheel this machine's indexes hold (no torchvision to match)
TORCH_SPEC = "torch==2.13.0"
DOCKER = ROOT / "docker"
TIMINGS: dict[str, float] = {}


def sh(command: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run a command; fail the test with the end of its output if it fails."""
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if done.returncode != 0:
        pytest.fail(
            f"{shlex.join(map(str, command))} exited {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def pytest_terminal_summary(terminalreporter) -> None:
    """Print how long the engine and image set-up took (fresh vs warm runs)."""
    if TIMINGS:
        steps = ", ".join(f"{k} {v:.0f}s" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"docker set-up: {steps}")


@pytest.fixture(scope="session")
def engine() -> Iterator[list[str]]:
    """Yield the compose command; stop the engine afterwards only if we started it."""
    started = time.monotonic()
    up = subprocess.run(
        [str(DOCKER / "engine.sh"), "up"], capture_output=True, text=True, check=False
    )
    if up.returncode != 0:
        pytest.skip(f"no Docker engine could be installed or started:\n{up.stderr}")
    TIMINGS["engine"] = time.monotonic() - started
    compose = sh([str(DOCKER / "engine.sh"), "compose"]).stdout.split()
    try:
        yield compose
    finally:
        # stops the daemon only if engine.sh started it and no one else uses it
        subprocess.run([str(DOCKER / "engine.sh"), "down"], check=False)


@pytest.fixture(scope="session")
def image(engine) -> str:
    """Build the base image (if missing), link the wheels and build the app image."""
    started = time.monotonic()
    sh([str(DOCKER / "build-base.sh"), BASE_IMAGE])
    TIMINGS["base image"] = time.monotonic() - started
    started = time.monotonic()
    sh(
        [str(DOCKER / "fetch-wheels.sh"), TORCH_SPEC],
        env={**os.environ, "PYTHON": sys.executable},
    )
    TIMINGS["wheels"] = time.monotonic() - started
    started = time.monotonic()
    sh(
        [
            "docker",
            "build",
            "-q",
            "-f",
            str(DOCKER / "Dockerfile"),
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "--build-arg",
            f"TORCH_SPEC={TORCH_SPEC}",
            "--build-arg",
            "PIP_OPTIONS=--no-index --find-links /wheels",
            "-t",
            IMAGE,
            str(ROOT),
        ]
    )
    TIMINGS["app image"] = time.monotonic() - started
    return IMAGE


class DockerProject(ComposeProject):
    """fedadapt's ComposeProject with what the tests also need."""

    def command(self, *args: str) -> list[str]:
        """``compose -p name -f ... <args>`` (to run without failing on exit)."""
        command = [*self.compose, "-p", self.name]
        for path in self.files:
            command += ["-f", str(path)]
        return [*command, *args]

    def container(self, service: str) -> str:
        """Id of the service's container."""
        return self("ps", "-q", service).strip()

    def use(self, override: str) -> None:
        """Add an override file of docker/ (e.g. compose.tls.yaml)."""
        self.files.append(DOCKER / override)


@pytest.fixture
def project(engine, image, tmp_path, request) -> Iterator[DockerProject]:
    """A compose project of its own; ``down -v`` and checked empty afterwards."""
    test = "".join(c for c in request.node.name.lower() if c.isalnum())
    # unique also across concurrent sessions on the same engine
    name = f"fad{test.removeprefix('test')[:24]}{secrets.token_hex(3)}"
    proj = DockerProject(engine, name, [DOCKER / "compose.yaml"], tmp_path, image)
    proj.prepare()  # results/ writable by the containers' uid 1000
    (tmp_path / "data").mkdir()
    try:
        yield proj
    finally:
        try:
            logs = subprocess.run(
                proj.command("logs", "--no-color", "--tail", "40"),
                capture_output=True,
                text=True,
                env=proj.env(),
                check=False,
            )
            print(logs.stdout[-8000:])
        finally:
            proj.down()
        assert proj.leftovers() == [], "compose down left these behind"
