"""How a suite spreads its cells over private Ray clusters (issue #39),
against Flower's own actor-pool sizing: every slot's pool must hold at least
one client, and the slots' pools together must fit the machine."""

from __future__ import annotations

import pytest

from fedadapt.tools.deploy.ray_cluster import (
    RAY_WORKER_PORTS,
    client_resources,
    parse_federation_config,
    slot_federation_config,
    suite_slots,
    worker_port_ranges,
)


def flower_pool_size(cpus: float, gpus: float, client: tuple[float, float]) -> int:
    """Flower's ``pool_size_from_resources`` for a one-node cluster (the
    oracle, re-derived from flwr/simulation/ray_transport/ray_actor.py)."""
    actors = int(cpus / client[0])
    if client[1] > 0:
        actors = min(actors, int(gpus / client[1])) if gpus else 0
    return actors


@pytest.mark.parametrize(
    "cpus, gpus, config, requested",
    [
        (2, 0, "client-resources-num-cpus=1", None),
        (16, 0, "client-resources-num-cpus=1", None),
        (16, 0, "", None),  # Flower's default: 2 CPUs a client
        (16, 0, "client-resources-num-cpus=3", 8),
        (16, 1, "client-resources-num-cpus=2 client-resources-num-gpus=0.25", None),
        (16, 1, "client-resources-num-cpus=1 client-resources-num-gpus=0.3", None),
        (8, 2, "client-resources-num-cpus=1 client-resources-num-gpus=1", None),
    ],
)
def test_the_slots_pools_fit_the_machine_together(cpus, gpus, config, requested):
    client = client_resources(config)
    slots = suite_slots(requested, 40, cpus, gpus, client)
    scaled = client_resources(slot_federation_config(config, slots))
    # each slot is a cluster of cpus // slots CPUs that sees every GPU
    pool = flower_pool_size(cpus // slots, gpus, scaled)
    assert pool >= 1, (slots, scaled)
    assert slots * pool * scaled[0] <= cpus
    assert slots * pool * client[1] <= gpus + 1e-9  # physical GPU shares
    assert scaled[1] <= 1 or float(scaled[1]).is_integer()  # Ray's rule


def test_slot_examples():
    assert suite_slots(None, 3, 2, 0, (1, 0)) == 1  # 2 cores: one slot
    assert suite_slots(2, 3, 2, 0, (1, 0)) == 2  # unless asked
    assert suite_slots(None, 3, 8, 0, (1, 0)) == 2  # one per four cores
    assert suite_slots(None, 3, 2, 0, (2, 0)) == 1
    assert suite_slots(None, 1, 64, 0, (1, 0)) == 1  # one cell
    assert suite_slots(None, 40, 64, 0, (1, 0)) == 4  # AUTO_SLOTS_MAX
    assert suite_slots(8, 40, 64, 0, (1, 0)) == 8
    assert suite_slots(None, 8, 16, 1, (1, 0.25)) == 4
    assert suite_slots(None, 8, 16, 1, (1, 0.3)) == 3  # 4 x 0.3 > 1 GPU
    assert suite_slots(None, 8, 1, 0, (2, 0)) == 1  # too small: Flower says so


def test_the_cell_config_keeps_other_keys_and_drops_init_args():
    config = "client-resources-num-cpus=1 init-args-num-cpus=4 verbose=true"
    assert (
        slot_federation_config(config, 1) == "client-resources-num-cpus=1 verbose=true"
    )
    assert (
        slot_federation_config(config, 3) == "client-resources-num-cpus=1 verbose=true"
    )
    gpu = "client-resources-num-gpus=0.25"
    assert slot_federation_config(gpu, 2) == "client-resources-num-gpus=0.5"


@pytest.mark.parametrize(
    "config, pattern",
    [
        ("client-resources-num-cpus", "KEY=VALUE"),
        ("client-resources-num-cpus=two", "must be a number"),
        ("client-resources-num-cpus=0", "must be > 0"),
        ("client-resources-num-gpus=-1", "must be ≥ 0"),
    ],
)
def test_bad_federation_configs_fail_naming_the_key(config, pattern):
    with pytest.raises(ValueError, match=pattern):
        client_resources(config)


def test_parse_keeps_the_order():
    assert list(parse_federation_config("b=1 a=2")) == ["b", "a"]


@pytest.mark.parametrize("clusters", [1, 2, 3, 4, 7])
def test_side_by_side_clusters_get_disjoint_worker_ports(clusters):
    ranges = worker_port_ranges(clusters)
    assert len(ranges) == clusters
    first, last = RAY_WORKER_PORTS
    ports = [set(range(lo, hi + 1)) for lo, hi in ranges]
    for i, mine in enumerate(ports):
        assert min(mine) >= first and max(mine) <= last
        assert len(mine) >= (last - first + 1) // clusters >= 1000
        for other in ports[i + 1 :]:
            assert not mine & other
    with pytest.raises(ValueError):
        worker_port_ranges(0)


def test_a_private_cluster_starts_with_its_worker_ports(tmp_path, monkeypatch):
    import subprocess

    from fedadapt.tools.deploy import ray_cluster

    commands: list[list[str]] = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(ray_cluster.subprocess, "run", fake_run)
    monkeypatch.setattr(ray_cluster, "program", lambda name: name)
    with ray_cluster.PrivateRayCluster(
        tmp_path, num_cpus=1, worker_ports=(12000, 12999)
    ):
        pass
    with ray_cluster.PrivateRayCluster(tmp_path, num_cpus=1):
        pass
    assert "--min-worker-port=12000" in commands[0]
    assert "--max-worker-port=12999" in commands[0]
    assert not any("worker-port" in part for part in commands[1])  # Ray's default


def test_a_suites_client_reserves_one_cpu_unless_told():
    """Flower's default (2 CPUs a client) runs one two-thread actor on a
    2-core machine, which trains a small model's clients 1.6x slower than two
    one-thread actors (docs/ray-cluster.md); a suite fills in 1, and keeps
    what the user gave."""
    from fedadapt.tools.deploy.ray_cluster import suite_federation_config

    assert client_resources(suite_federation_config("")) == (1.0, 0.0)
    assert client_resources(
        suite_federation_config("client-resources-num-gpus=0.25")
    ) == (1.0, 0.25)
    given = "client-resources-num-cpus=2 verbose=true"
    assert suite_federation_config(given) == given
    one = client_resources(suite_federation_config(""))
    assert suite_slots(None, 8, 2, 0, one) == 1


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), "client-resources-num-cpus=1"),
        (("--federation-config", "client-resources-num-cpus=2"),
         "client-resources-num-cpus=2"),
        (("--federation-config", "client-resources-num-gpus=0.5"),
         "client-resources-num-gpus=0.5 client-resources-num-cpus=1"),
    ],
)  # fmt: skip
def test_fedadapt_simulate_gives_a_client_one_cpu_unless_told(
    flags, expected, tmp_path, monkeypatch
):
    """`fedadapt simulate` hands flwr run the same client CPUs as a suite's
    cell: one unless the user's --federation-config says otherwise (the
    SuperLink and flwr run are stand-ins that record what they were given)."""
    from contextlib import nullcontext

    from fedadapt.tools import cli
    from fedadapt.tools.submission import RunOutcome

    given: dict[str, str] = {}

    def submit_run(*args, federation_config="", **kwargs):
        given["federation_config"] = federation_config
        return RunOutcome(1, "finished:completed", "", 0.1, None, [])

    monkeypatch.setattr(cli, "SimulationSuperLink", lambda *a: nullcontext())
    monkeypatch.setattr(cli, "submit_run", submit_run)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["simulate", "--app", str(tmp_path), *flags]) == 0
    assert given["federation_config"] == expected
