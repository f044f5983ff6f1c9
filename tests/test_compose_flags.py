"""Static checks of docker/: every daemon flag exists in Flower 1.41 (issue #11).

The GPU override cannot run here (no GPU in containers); these checks hold for
every compose file: each service's command names a Flower daemon whose
installed ``--help`` lists every flag it passes, GPU reservations are well
formed, and the compose files use only loopback-published ports.
"""

from __future__ import annotations

import subprocess
from functools import cache

import pytest
import yaml

from tests.helpers import ROOT, VENV_BIN

DOCKER = ROOT / "docker"
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))


@cache
def _help(daemon: str) -> str:
    done = subprocess.run(
        [str(VENV_BIN / daemon), "--help"], capture_output=True, text=True, check=True
    )
    return done.stdout


def _services(path):
    return yaml.safe_load(path.read_text())["services"]


def _commands():
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            if "command" in service:
                yield pytest.param(service["command"], id=f"{path.stem}:{name}")


@pytest.mark.parametrize("command", list(_commands()))
def test_every_flag_exists_in_the_installed_daemon(command):
    daemon, *args = command
    assert daemon in {"flower-superlink", "flower-supernode", "flower-superexec"}
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert flags, "a daemon without flags"
    for flag in flags:
        assert f"{flag} " in _help(daemon) or f"{flag}\n" in _help(daemon), (
            f"{daemon} has no {flag}"
        )


def test_ports_are_published_on_loopback_only():
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            for port in service.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{path.name}:{name}"


def test_gpu_override_reserves_nvidia_devices_for_every_service():
    base = set(_services(DOCKER / "compose.yaml"))
    gpu = _services(DOCKER / "compose.gpu.yaml")
    assert set(gpu) == base
    for service in gpu.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_tls_override_mounts_secrets_read_only_and_each_node_only_its_key():
    tls = _services(DOCKER / "compose.tls.yaml")
    for name, service in tls.items():
        for volume in service["volumes"]:
            assert volume.endswith(":ro"), f"{name}: {volume}"
        keys = [v for v in service["volumes"] if ".key" in v]
        if name.startswith("supernode-"):
            assert keys == [
                f"${{FEDADAPT_CERTS:-../certs}}/{name}.key:/certs/supernode.key:ro"
            ]
        else:
            assert keys == [
                "${FEDADAPT_CERTS:-../certs}/server.key:/certs/server.key:ro"
            ]
