"""Seeded client sampling (server/policy.py): reruns train the same partitions.

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
from flwr.serverapp import Grid

from fedadapt.server.policy import RunStrategy
from fedadapt.strategies.core import FedAvgRule
from tests.helpers import make_reply, run_in_process

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


def test_global_rng_is_left_as_it_was():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    _sampled_partitions(*_a_run(run_seed=1, sampling_seed=5), [1, 2, 3])
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
def test_simulation_reruns_train_the_same_partitions(tmp_path):
    """Two Flower simulations with the same seed (fresh random node ids each)
    sample the same partitions and end with the same model; results.json
    records the partitions."""
    runs = {}
    for name in ("a", "b"):
        run_in_process(
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
    assert [r["sampled"] for r in a] == [r["sampled"] for r in b]
    for entry in a:
        for phase in ("train", "evaluate"):
            sample = entry["sampled"][phase]
            assert len(sample) == 2 and set(sample) <= set(range(6)), entry
    assert [r["eval"]["loss"] for r in a] == [r["eval"]["loss"] for r in b]


def test_partition_query_keeps_only_integer_answers_and_bounds_its_wait():
    """node_partitions: an error reply, a missing, float or NaN
    partition-id are left out (those nodes are sampled last), never crash."""
    from fedadapt.server.server_app import node_partitions

    answers = {
        1: {"partition-id": 3},
        2: {"partition-id": 0},
        3: None,  # the node's ClientApp failed
        4: {"num-partitions": 5},  # no partition-id
        5: {"partition-id": 1.5},
        6: {"partition-id": float("nan")},
    }
    replies = [
        make_reply(None, metrics or {}, node, error=metrics is None)
        for node, metrics in answers.items()
    ]
    grid = Mock(spec=Grid)
    grid.get_node_ids.return_value = list(answers)
    grid.send_and_receive.return_value = replies
    assert node_partitions(grid, timeout=7.0) == {1: 3, 2: 0}
    sent = grid.send_and_receive.call_args
    assert sent.kwargs["timeout"] == 7.0
    assert sorted(m.metadata.dst_node_id for m in sent.args[0]) == list(answers)
    assert {m.metadata.message_type for m in sent.args[0]} == {"query"}
