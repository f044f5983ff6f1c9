"""Seeded client sampling (server/policy.py): reruns train the same partitions.

Both APIs: RunStrategy (Message API) and LegacyRunStrategy (legacy API), which
must also sample the same partitions as each other for the same seed.

Flower samples with the module-level RNG over node ids that are random per
run; with ``sampling_seed`` and ``node_keys`` (node id -> partition-id) the
sample must depend only on the seed, the phase, the global round and the
connected partitions.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common import (
    Code,
    FitRes,
    GetPropertiesRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.serverapp import Grid

from fedadapt.server.policy import LegacyRunStrategy, RunStrategy
from fedadapt.strategies.core import FedAvgRule
from tests.helpers import make_reply, run_in_process, run_legacy_in_process

NUM_NODES, PER_ROUND = 10, 3


pytestmark = pytest.mark.usefixtures("task_identity")


def _a_run(run_seed: int, sampling_seed: int | None, per_eval: int = 0):
    """A strategy and grid as one run sees them: fresh random node ids, listed
    in an arbitrary order, each holding one of the partitions 0..NUM_NODES-1."""
    rng = random.Random(run_seed)
    node_ids = [rng.getrandbits(63) for _ in range(NUM_NODES)]
    strategy = RunStrategy(
        FedAvgRule(),
        fraction_train=PER_ROUND / NUM_NODES,
        min_train_nodes=PER_ROUND,
        fraction_evaluate=per_eval / NUM_NODES,
        min_evaluate_nodes=per_eval,
        min_available_nodes=PER_ROUND,
    )
    strategy.sampling_seed = sampling_seed
    partitions = rng.sample(range(NUM_NODES), NUM_NODES)
    strategy.node_keys = dict(zip(node_ids, partitions, strict=True))
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = rng.sample(node_ids, NUM_NODES)
    return strategy, grid


ARRAYS = ArrayRecord({"w": Array(np.zeros(3, np.float32))})


def _sampled_partitions(strategy, grid, rounds, phase="train"):
    """Partition-ids of the nodes each round's messages go to."""
    samples = []
    for server_round in rounds:
        configure = (
            strategy.configure_train
            if phase == "train"
            else strategy.configure_evaluate
        )
        messages = list(configure(server_round, ARRAYS, ConfigRecord(), grid))
        samples.append(
            sorted(strategy.node_keys[m.metadata.dst_node_id] for m in messages)
        )
    return samples


def test_same_seed_same_partitions_whatever_the_node_ids():
    first = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=7), range(1, 31))
    second = _sampled_partitions(*_a_run(run_seed=2, sampling_seed=7), range(1, 31))
    assert first == second
    assert all(len(s) == PER_ROUND and len(set(s)) == PER_ROUND for s in first)
    assert len({tuple(s) for s in first}) > 10  # rounds differ from each other
    other = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=8), range(1, 31))
    assert other != first


def test_results_record_the_sampled_partitions():
    strategy, grid = _a_run(run_seed=1, sampling_seed=0)
    samples = _sampled_partitions(strategy, grid, [1, 2])
    assert [strategy.round_reports[r]["sampled"]["train"] for r in (1, 2)] == samples


def test_unseeded_sampling_is_flowers_and_differs_between_runs():
    """Without a seed the partitions trained depend on Flower's RNG (the old
    behaviour): two runs under different global RNG states differ."""
    random.seed(0)
    first = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=None), range(1, 11))
    random.seed(1)
    second = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=None), range(1, 11))
    assert first != second


def test_seeded_sampling_is_uniform_over_partitions():
    """Every partition is sampled about PER_ROUND / NUM_NODES of the rounds
    (binomial, 300 rounds: mean 90, sd 7.9; bounds at 4 sd)."""
    samples = _sampled_partitions(*_a_run(run_seed=3, sampling_seed=0), range(1, 301))
    counts = Counter(p for s in samples for p in s)
    assert set(counts) == set(range(NUM_NODES))
    assert all(58 <= c <= 122 for c in counts.values()), counts


@pytest.mark.parametrize(
    "sample_rounds",
    [
        lambda: _sampled_partitions(*_a_run(run_seed=1, sampling_seed=5), [1, 2, 3]),
        lambda: _legacy_sampled(*_a_legacy_run(run_seed=1, sampling_seed=5), [1, 2, 3]),
    ],
    ids=["message-api", "legacy-api"],
)
def test_global_rng_is_left_as_it_was(sample_rounds):
    random.seed(123)
    expected = random.random()
    random.seed(123)
    sample_rounds()
    assert random.random() == expected


def test_evaluation_sample_is_seeded_and_drawn_apart_from_training():
    runs = [_a_run(run_seed=s, sampling_seed=4, per_eval=5) for s in (1, 2)]
    evals = [_sampled_partitions(st, g, range(1, 21), "evaluate") for st, g in runs]
    assert evals[0] == evals[1]
    assert all(len(s) == 5 for s in evals[0])
    trains = _sampled_partitions(*runs[0], range(1, 21))
    assert [set(e) >= set(t) for e, t in zip(evals[0], trains, strict=True)].count(
        False
    ) > 0  # not the training sample padded: an independent draw


def test_resume_samples_what_the_uninterrupted_run_would():
    """After a resume Flower counts rounds from 1 again; round_offset makes the
    seeded sample that of the global round."""
    whole = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=2), range(1, 7))
    strategy, grid = _a_run(run_seed=9, sampling_seed=2)  # new node ids after restart
    strategy.round_offset = 3
    assert _sampled_partitions(strategy, grid, range(1, 4)) == whole[3:]


def test_missing_node_keys_sort_last_and_sampling_still_works():
    strategy, grid = _a_run(run_seed=1, sampling_seed=0)
    unknown = next(iter(strategy.node_keys))
    del strategy.node_keys[unknown]
    messages = list(strategy.configure_train(1, ARRAYS, ConfigRecord(), grid))
    assert len(messages) == PER_ROUND


def test_aggregate_does_not_depend_on_reply_arrival_order():
    """Floating-point sums depend on their order ((1e16 + 1) - 1e16 is 0, while
    (1e16 - 1e16) + 1 is 1); replies are aggregated in partition order, so any
    arrival order gives bit-identical weights."""
    x0 = np.zeros(2, np.float32)
    values = {11: 1e16, 22: 1.0, 33: -1e16, 44: 3.0}
    results = []
    for order in ([11, 22, 33, 44], [11, 33, 22, 44], [44, 22, 33, 11]):
        strategy = RunStrategy(FedAvgRule(), fraction_train=1.0, min_train_nodes=4)
        strategy.node_keys = {11: 2, 22: 0, 33: 3, 44: 1}
        grid = Mock(spec=Grid)
        grid.get_node_ids.return_value = list(values)
        record = ArrayRecord({"w": Array(x0)})
        list(strategy.configure_train(1, record, ConfigRecord(), grid))
        replies = [
            make_reply(
                {"w": np.full(2, values[n], np.float32)},
                {"num-examples": 10, "loss": 1.0},
                n,
            )
            for n in order
        ]
        new, _ = strategy.aggregate_train(1, replies)
        results.append(new["w"].numpy())
    assert np.array_equal(results[0], results[1]), results
    assert np.array_equal(results[0], results[2]), results


@pytest.mark.e2e
@pytest.mark.parametrize(
    # legacy: with make test-deploy (CI's 20-minute budget for the default suite)
    "api",
    # both with make test-deploy (~90 s each here; the partition-query unit
    # tests cover late answers in both APIs in the default suite)
    [pytest.param(api, marks=pytest.mark.deploy) for api in ("message", "legacy")],
)
def test_simulation_reruns_train_the_same_partitions(tmp_path, api):
    """Two Flower simulations with the same seed (fresh random node ids each)
    sample the same partitions and end with the same model; results.json
    records the partitions. Legacy: NumPyClients answer get_properties."""
    run = run_in_process if api == "message" else run_legacy_in_process
    runs = {}
    for name in ("a", "b"):
        run(
            {
                "output-dir": str(tmp_path),
                "run-name": name,
                "num-server-rounds": 3,
                "clients-per-round": 2,
                "clients-per-eval": 2,
                "local-steps": 3,
            },
            num_supernodes=6,
        )
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    a, b = runs["a"]["rounds"], runs["b"]["rounds"]
    assert runs["a"]["status"] == runs["b"]["status"] == "completed"
    assert [r["sampled"] for r in a] == [r["sampled"] for r in b]
    for entry in a:
        for phase in ("train", "evaluate"):
            sample = entry["sampled"][phase]
            assert len(sample) == 2 and set(sample) <= set(range(6)), entry
    assert [r["eval"]["loss"] for r in a] == [r["eval"]["loss"] for r in b]


# --- the legacy API (LegacyRunStrategy) -------------------------------------------


def _legacy_client(cid: str, answer):
    """A ClientProxy whose get_properties returns ``answer`` (raises if an
    exception), counting the calls."""
    proxy = Mock(spec=ClientProxy)
    proxy.cid = cid
    if isinstance(answer, Exception):
        proxy.get_properties.side_effect = answer
    else:
        proxy.get_properties.return_value = GetPropertiesRes(
            Status(Code.OK, ""), answer
        )
    return proxy


def _a_legacy_run(run_seed: int, sampling_seed: int | None, per_eval: int = 0):
    """As _a_run for the legacy API: a real SimpleClientManager holding
    clients with fresh random cids, registered in an arbitrary order."""
    rng = random.Random(run_seed)
    cids = [str(rng.getrandbits(63)) for _ in range(NUM_NODES)]
    partitions = rng.sample(range(NUM_NODES), NUM_NODES)
    manager = SimpleClientManager()
    for cid, pid in rng.sample(list(zip(cids, partitions, strict=True)), NUM_NODES):
        manager.register(_legacy_client(cid, {"partition-id": pid}))
    strategy = LegacyRunStrategy(
        FedAvgRule(),
        sampling_seed=sampling_seed,
        fraction_fit=0.0,
        min_fit_clients=PER_ROUND,
        min_available_clients=PER_ROUND,
        fraction_evaluate=1e-9 if per_eval else 0.0,
        min_evaluate_clients=per_eval,
    )
    return strategy, manager


LEGACY_PARAMETERS = ndarrays_to_parameters([np.zeros(3, np.float32)])


def _legacy_sampled(strategy, manager, rounds, phase="train"):
    """Partition-ids of the clients each legacy round is sent to."""
    truth = {
        c.cid: c.get_properties.return_value.properties["partition-id"]
        for c in manager.all().values()
    }
    configure = (
        strategy.configure_fit if phase == "train" else strategy.configure_evaluate
    )
    return [
        sorted(
            truth[proxy.cid] for proxy, _ in configure(r, LEGACY_PARAMETERS, manager)
        )
        for r in rounds
    ]


def test_legacy_samples_the_partitions_the_message_api_samples():
    """Same seed, same rounds: the legacy app trains (and evaluates) exactly
    the partitions the Message-API app does, whatever the cids and the
    registration order — Flower's Message-API sampler is the oracle."""
    message = _sampled_partitions(*_a_run(run_seed=1, sampling_seed=7), range(1, 31))
    for run_seed in (2, 3):
        legacy = _legacy_sampled(*_a_legacy_run(run_seed, 7), range(1, 31))
        assert legacy == message
    message_eval = _sampled_partitions(
        *_a_run(run_seed=1, sampling_seed=4, per_eval=5), range(1, 11), "evaluate"
    )
    legacy_eval = _legacy_sampled(
        *_a_legacy_run(5, 4, per_eval=5), range(1, 11), "evaluate"
    )
    assert legacy_eval == message_eval
    assert len({tuple(s) for s in message}) > 10  # rounds differ from each other


def test_legacy_asks_each_client_once_and_records_the_sample():
    strategy, manager = _a_legacy_run(run_seed=1, sampling_seed=0)
    samples = _legacy_sampled(strategy, manager, range(1, 6))
    for client in manager.all().values():
        assert client.get_properties.call_count == 1
    assert [strategy.round_reports[r]["sampled"]["train"] for r in range(1, 6)] == (
        samples
    )


def test_legacy_unseeded_sampling_is_flowers_and_asks_nobody():
    random.seed(0)
    strategy, manager = _a_legacy_run(run_seed=1, sampling_seed=None)
    first = _legacy_sampled(strategy, manager, range(1, 11))
    random.seed(1)
    second = _legacy_sampled(
        *_a_legacy_run(run_seed=1, sampling_seed=None), range(1, 11)
    )
    assert first != second
    assert not any(c.get_properties.called for c in manager.all().values())
    assert all("sampled" not in r for r in strategy.round_reports.values())


def test_legacy_every_client_sampled_asks_nobody():
    """Training every client is not a sample: no query, as the Message API."""
    strategy, manager = _a_legacy_run(run_seed=1, sampling_seed=0)
    strategy.min_fit_clients = NUM_NODES
    pairs = strategy.configure_fit(1, LEGACY_PARAMETERS, manager)
    assert len(pairs) == NUM_NODES
    assert not any(c.get_properties.called for c in manager.all().values())


def test_legacy_client_without_partition_id_is_sampled_last():
    """A client that answers without a partition-id (its own data only) sorts
    after the others and still trains. Late, failing and invalid answers:
    tests/server/test_partition_query.py (asked again, or the run fails)."""
    answers = {
        "a": {"partition-id": 2},
        "c": {"num-partitions": 6},
        "f": {"partition-id": 0},
    }
    manager = SimpleClientManager()
    for cid, answer in answers.items():
        manager.register(_legacy_client(cid, answer))
    strategy = LegacyRunStrategy(
        FedAvgRule(), sampling_seed=0, fraction_fit=0.0, min_fit_clients=2
    )
    pairs = strategy.configure_fit(1, LEGACY_PARAMETERS, manager)
    assert len(pairs) == 2
    assert strategy.partitions == {"a": 2, "f": 0}
    order = sorted(manager.all().values(), key=strategy.client_order)
    assert [c.cid for c in order] == ["f", "a", "c"]


def test_legacy_aggregate_does_not_depend_on_reply_arrival_order():
    """As the Message-API test above: replies summed in partition order."""
    values = {"11": 1e16, "22": 1.0, "33": -1e16, "44": 3.0}
    keys = {"11": 2, "22": 0, "33": 3, "44": 1}
    results = []
    for order in (
        ["11", "22", "33", "44"],
        ["11", "33", "22", "44"],
        ["44", "22", "33", "11"],
    ):
        strategy = LegacyRunStrategy(FedAvgRule(), fraction_fit=1.0)
        strategy.partitions = dict(keys)
        manager = SimpleClientManager()
        proxies = {
            cid: _legacy_client(cid, {"partition-id": keys[cid]}) for cid in values
        }
        for proxy in proxies.values():
            manager.register(proxy)
        strategy.configure_fit(1, LEGACY_PARAMETERS, manager)
        replies = [
            (
                proxies[cid],
                FitRes(
                    Status(Code.OK, ""),
                    ndarrays_to_parameters([np.full(3, values[cid], np.float32)]),
                    10,
                    {},
                ),
            )
            for cid in order
        ]
        new, _ = strategy.aggregate_fit(1, replies, [])
        results.append(parameters_to_ndarrays(new)[0])
    assert np.array_equal(results[0], results[1]), results
    assert np.array_equal(results[0], results[2]), results
