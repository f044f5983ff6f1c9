"""Static checks of docker/: every daemon flag exists in the installed Flower (#11).

The GPU override cannot run here (no GPU in containers); these checks hold for
every compose file: each service's command names a Flower daemon whose
installed ``--help`` lists every flag it passes, GPU reservations are well
formed, the compose files use only loopback-published ports, every
combination of overrides parses and merges in the installed compose tool
(skipped where none is installed), and the image runs as a non-root user
with nothing secret in its build context.
"""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import ROOT, compose_config, daemon_has_flag

DOCKER = ROOT / "docker"
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yaml"))


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
    assert daemon in {
        "flower-superlink",
        "flower-supernode",
        "fedadapt-supernode",  # flower-supernode's flags (docs/deployment.md)
        "flower-superexec",
    }
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    assert flags, "a daemon without flags"
    for flag in flags:
        assert daemon_has_flag(daemon, flag), f"{daemon} has no {flag}"


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


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["compose.tls.yaml"],
        ["compose.gpu.yaml"],
        ["compose.tls.yaml", "compose.gpu.yaml"],
    ],
    ids=["base", "tls", "gpu", "tls+gpu"],
)
def test_compose_files_parse_and_merge(overrides, tmp_path):
    files = [DOCKER / name for name in ["compose.yaml", *overrides]]
    merged = compose_config(files, {"FEDADAPT_CERTS": str(tmp_path)})["services"]
    assert set(merged) == {"superlink", "supernode-1", "supernode-2", "supernode-3"}
    superlink = merged["superlink"]
    if "compose.gpu.yaml" in overrides:
        assert superlink["build"]["args"]["TORCH_VARIANT"] == "gpu"
        for service in merged.values():
            assert service["image"] == "fedadapt:gpu"
            devices = service["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia"
    else:
        assert superlink["build"]["args"]["TORCH_VARIANT"] == "cpu"
    if "compose.tls.yaml" in overrides:
        assert "--enable-supernode-auth" in superlink["command"]
        assert "--insecure" not in " ".join(
            " ".join(s["command"]) for s in merged.values()
        )
    # the SuperLink keeps the state volume and the results mount in every variant
    targets = {
        str(v).split(":")[1] if isinstance(v, str) else v["target"]
        for v in superlink["volumes"]
    }
    assert {"/data", "/results"} <= targets


def test_image_runs_as_non_root_and_context_holds_no_secrets():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in dockerfile
    users = [
        line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")
    ]
    assert users and users[-1] not in {"root", "0"}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    # everything is excluded except what the image needs: no keys, no certs
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"
    assert all(
        r.startswith("!") or "__pycache__" in r or r.endswith(".pyc") for r in rules[1:]
    )
    assert not any("cert" in r or ".key" in r for r in rules if r.startswith("!"))


def test_superexec_task_poll_is_shortened_the_same_way_everywhere(monkeypatch):
    """fedadapt deploy and the compose files poll for tasks every 0.25 s (#40).

    Flower reads FLWR_SUPEREXEC_TASK_POLL_INTERVAL (default 1 s); a value the
    user set wins in both.
    """
    from fedadapt.tools.deploy.process import TASK_POLL_INTERVAL_S, flower_env

    key = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
    monkeypatch.delenv(key, raising=False)
    assert flower_env(ROOT)[key] == TASK_POLL_INTERVAL_S == "0.25"
    monkeypatch.setenv(key, "2")
    assert flower_env(ROOT)[key] == "2"
    anchor = yaml.safe_load((DOCKER / "compose.yaml").read_text())["x-fedadapt"]
    assert anchor["environment"][key] == f"${{{key}:-{TASK_POLL_INTERVAL_S}}}"
