"""Issue #27 parts 3, 4, 6 through each API's real round loop, in process.

Deterministic fake clients (a contraction towards a per-client target that
also depends on the server round, so round numbering matters) run behind
a fake Message-API Grid and behind legacy ClientProxies driven by Flower's
own legacy ``Server``. Part 3: the returned model scores exactly what was
reported last. Part 4: a run saved to Flower records (and bytes on disk)
after k rounds and resumed in a new strategy ends bit-identical to an
uninterrupted one. Part 6: the stop rules end the run where a reference
loop written here says they must.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import (
    Code,
    EvaluateRes,
    FitRes,
    GetPropertiesRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import Server, SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedadapt.strategies import (
    FedAdam,
    FedDuA,
    FedExP,
    legacy,
    records_from_bytes,
    records_to_bytes,
)
from tests.helpers import make_reply

pytestmark = pytest.mark.usefixtures("task_identity")

NAMES = ["w", "b"]
X0 = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3),
      "b": np.array([0.5, -0.25], np.float32)}  # fmt: skip
NUM_CLIENTS = 3
TARGET = {k: np.full_like(v, 2.0) for k, v in X0.items()}

MESSAGE = {"feddua": FedDuA, "fedexp": FedExP, "fedadam": FedAdam}
LEGACY = {"feddua": legacy.FedDuA, "fedexp": legacy.FedExP, "fedadam": legacy.FedAdam}


def _target(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in X0.items()}


def local_train(i: int, x: dict, server_round: int) -> dict[str, np.ndarray]:
    """Client i: half way to its target, plus a round-dependent drift."""
    t = _target(i)
    return {
        k: (x[k] + np.float32(0.5) * (t[k] - x[k]) + np.float32(0.01 * server_round))
        .astype(np.float32)
        for k in x
    }  # fmt: skip


def score(x: dict) -> dict[str, float]:
    """Central evaluation: float64 squared distance to TARGET and a 'accuracy'."""
    loss = math.fsum(float(np.sum((x[k].astype(np.float64) - TARGET[k]) ** 2))
                     for k in x)  # fmt: skip
    return {"loss": loss, "accuracy": 1.0 / (1.0 + loss)}


def client_score(i: int, x: dict) -> float:
    t = _target(i)
    return math.fsum(float(np.sum((x[k].astype(np.float64) - t[k]) ** 2)) for k in x)


# --- the Message API: a fake Grid ------------------------------------------------


class FakeGrid:
    """A Grid whose nodes are the fake clients (node id = client index + 1)."""

    def __init__(self) -> None:
        self.train_calls = 0

    def get_node_ids(self) -> list[int]:
        return list(range(1, NUM_CLIENTS + 1))

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            i = node - 1
            content = message.content
            x = {k: v.numpy() for k, v in content["arrays"].items()}
            rnd = int(content["config"]["server-round"])
            n = 10 * (i + 1)  # distinct weights: a content-defined order
            if message.metadata.message_type == "train":
                self.train_calls += 1
                new = local_train(i, x, rnd)
                metrics = {"num-examples": n, "train-loss": client_score(i, x)}
                replies.append(make_reply(new, metrics, node))
            else:
                metrics = {"num-examples": n, "eval-loss": client_score(i, x)}
                replies.append(make_reply(None, metrics, node))
        return replies


def _evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord(score({k: v.numpy() for k, v in arrays.items()}))


def _record(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def _message_run(strategy, num_rounds, initial=None, grid=None, **start_kwargs):
    return strategy.start(
        grid=grid or FakeGrid(),
        initial_arrays=initial if initial is not None else _record(X0),
        num_rounds=num_rounds,
        evaluate_fn=_evaluate_fn,
        **start_kwargs,
    )


def _message_strategy(name, **kwargs):
    return MESSAGE[name](fraction_evaluate=1.0, min_available_nodes=NUM_CLIENTS,
                         **kwargs)  # fmt: skip


# --- the legacy API: Flower's Server with fake ClientProxies -------------------------


class FakeProxy(ClientProxy):
    """A legacy client: the same local training and evaluation."""

    def __init__(self, i: int) -> None:
        super().__init__(str(i))
        self.i = i
        self.fit_calls = 0

    def _model(self, parameters):
        return dict(zip(NAMES, parameters_to_ndarrays(parameters), strict=True))

    def fit(self, ins, timeout, group_id):
        self.fit_calls += 1
        new = local_train(self.i, self._model(ins.parameters), group_id)
        params = ndarrays_to_parameters([new[k] for k in NAMES])
        metrics = {"train-loss": client_score(self.i, self._model(ins.parameters))}
        return FitRes(Status(Code.OK, ""), params, 10 * (self.i + 1), metrics)

    def evaluate(self, ins, timeout, group_id):
        loss = client_score(self.i, self._model(ins.parameters))
        return EvaluateRes(Status(Code.OK, ""), loss, 10 * (self.i + 1), {})

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(Status(Code.OK, ""), {})

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def _legacy_evaluate_fn(server_round, ndarrays, config):
    scores = score(dict(zip(NAMES, ndarrays, strict=True)))
    return scores["loss"], scores


def _legacy_strategy(name, initial=None, **kwargs):
    initial = initial if initial is not None else [X0[k] for k in NAMES]
    return LEGACY[name](
        array_names=NAMES, initial_parameters=ndarrays_to_parameters(initial),
        evaluate_fn=_legacy_evaluate_fn, fraction_fit=1.0, fraction_evaluate=1.0,
        min_fit_clients=NUM_CLIENTS, min_evaluate_clients=NUM_CLIENTS,
        min_available_clients=NUM_CLIENTS,
        fit_metrics_aggregation_fn=_mean_metrics, **kwargs,
    )  # fmt: skip


def _mean_metrics(results):
    total = sum(n for n, _ in results)
    return {k: sum(n * m[k] for n, m in results) / total for k in results[0][1]}


def _legacy_run(strategy, num_rounds):
    manager = SimpleClientManager()
    proxies = [FakeProxy(i) for i in range(NUM_CLIENTS)]
    for proxy in proxies:
        manager.register(proxy)
    server = Server(client_manager=manager, strategy=strategy)
    history, _ = server.fit(num_rounds, timeout=None)
    model = dict(zip(NAMES, parameters_to_ndarrays(server.parameters), strict=True))
    return model, history, proxies


# --- part 3: the model returned is the model reported -------------------------------


@pytest.mark.parametrize("name", ["feddua", "fedexp"])
def test_message_api_returns_the_model_whose_metrics_it_reported(name):
    result = _message_run(_message_strategy(name), num_rounds=3)
    returned = _numpy(result.arrays)
    # central evaluation of the returned arrays: exactly the last reported one
    assert score(returned) == dict(result.evaluate_metrics_serverapp[3])
    # and the clients' evaluation of the returned arrays too
    n = [10 * (i + 1) for i in range(NUM_CLIENTS)]
    fed = sum(w * client_score(i, returned) for i, w in enumerate(n)) / sum(n)
    assert fed == pytest.approx(result.evaluate_metrics_clientapp[3]["eval-loss"],
                                rel=1e-12)  # fmt: skip


@pytest.mark.parametrize("name", ["feddua", "fedexp"])
def test_legacy_api_ends_with_the_model_whose_metrics_it_reported(name):
    model, history, _ = _legacy_run(_legacy_strategy(name), num_rounds=3)
    last_round, last_loss = history.losses_centralized[-1]
    assert last_round == 3
    assert score(model)["loss"] == last_loss
    assert score(model)["accuracy"] == history.metrics_centralized["accuracy"][-1][1]


def test_the_returned_model_is_the_average_of_the_last_two_iterates():
    """Oracle: w_2 and w_3 from a run without averaging (same iterates)."""
    w = [
        _numpy(_message_run(_message_strategy("fedexp", average_last_two=False),
                            num_rounds=r).arrays)
        for r in (2, 3)
    ]  # fmt: skip
    averaged = _numpy(_message_run(_message_strategy("fedexp"), num_rounds=3).arrays)
    for k in NAMES:
        want = ((w[0][k] + w[1][k]) / 2).astype(np.float32)
        np.testing.assert_array_equal(averaged[k], want)


# --- part 4: state in Flower's records, resumed at round k ---------------------------

ROUNDS, SPLIT = 5, 2


def _through_disk(records, path):
    """Write records as bytes to a file and read them back (a user's checkpoint)."""
    path.write_bytes(records_to_bytes(records))
    return records_from_bytes(path.read_bytes())


def _assert_same_metrics(got: dict, want: dict, rounds) -> None:
    for r in rounds:
        assert dict(got[r]) == dict(want[r]), r


@pytest.mark.parametrize("name", ["feddua", "fedexp", "fedadam"])
def test_message_api_resumes_bit_identically_from_records_on_disk(name, tmp_path):
    whole = _message_run(_message_strategy(name), num_rounds=ROUNDS)
    # run SPLIT rounds, keep model and state as a user would: records, on disk
    first = _message_strategy(name)
    part = _message_run(first, num_rounds=SPLIT)
    saved = _through_disk(RecordDict({"model": part.arrays}), tmp_path / "m.bin")
    model = saved.array_records["model"]
    state = _through_disk(first.state_to_records(), tmp_path / "state.bin")
    # a new strategy continues at round SPLIT + 1
    second = _message_strategy(name)
    second.load_state_records(state)
    rest = _message_run(second, num_rounds=ROUNDS, initial=model)
    for k in NAMES:
        assert _numpy(rest.arrays)[k].tobytes() == _numpy(whole.arrays)[k].tobytes()
    later = range(SPLIT + 1, ROUNDS + 1)
    assert sorted(rest.train_metrics_clientapp) == list(later)
    _assert_same_metrics(rest.train_metrics_clientapp,
                         whole.train_metrics_clientapp, later)  # fmt: skip
    _assert_same_metrics(rest.evaluate_metrics_serverapp,
                         whole.evaluate_metrics_serverapp, later)  # fmt: skip
    # the initial evaluation of the resumed run is round SPLIT's, unchanged
    assert dict(rest.evaluate_metrics_serverapp[SPLIT]) == dict(
        whole.evaluate_metrics_serverapp[SPLIT]
    )


def test_message_api_state_fits_context_state():
    """``context.state`` is a RecordDict: the records go in and come out whole."""
    from flwr.app import Context

    strategy = _message_strategy("feddua")
    _message_run(strategy, num_rounds=2)
    context = Context(1, 0, {}, RecordDict(), {})
    context.state.update(strategy.state_to_records())
    restored = _message_strategy("feddua")
    restored.load_state_records(context.state)
    assert restored.completed_round == 2
    got, want = restored.rule.state_dict(), strategy.rule.state_dict()
    assert got["m"] == want["m"] and got["num_updates"] == want["num_updates"] == 2
    for key in ("s", "v"):
        for k in NAMES:
            a, b = got[key][k], want[key][k]
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", ["feddua", "fedexp", "fedadam"])
def test_legacy_api_resumes_bit_identically_from_records_on_disk(name, tmp_path):
    whole_model, whole, _ = _legacy_run(_legacy_strategy(name), ROUNDS)
    first = _legacy_strategy(name)
    model, _, _ = _legacy_run(first, SPLIT)
    state = _through_disk(first.state_to_records(), tmp_path / "state.bin")
    second = _legacy_strategy(name, initial=[model[k] for k in NAMES])
    second.load_state_records(state)
    rest_model, rest, proxies = _legacy_run(second, ROUNDS)  # same num_rounds
    for k in NAMES:
        assert rest_model[k].tobytes() == whole_model[k].tobytes()
    # rounds 1 … SPLIT did nothing; the later ones report what the whole run did
    assert rest.losses_centralized == whole.losses_centralized[SPLIT + 1 :]
    # Flower sums the clients' losses in arrival order: equal up to rounding
    for (r, got), (w, want) in zip(
        rest.losses_distributed, whole.losses_distributed[SPLIT:], strict=True
    ):
        assert r == w and got == pytest.approx(want, rel=1e-12)
    assert all(p.fit_calls == ROUNDS - SPLIT for p in proxies)


def test_resuming_from_other_arrays_trains_from_them_and_warns(caplog):
    """The saved iterate is used only for the model saved with it."""
    first = _message_strategy("fedexp")
    _message_run(first, num_rounds=1)
    second = _message_strategy("fedexp")
    second.load_state_records(first.state_to_records())
    other = {k: v + np.float32(1) for k, v in X0.items()}
    grid = FakeGrid()
    messages = list(second.configure_train(2, _record(other), ConfigRecord(), grid))
    sent = _numpy(messages[0].content["arrays"])
    assert all(np.array_equal(sent[k], other[k]) for k in NAMES)
    assert "not the model saved with the loaded strategy state" in caplog.text


def test_state_records_reject_what_they_cannot_hold():
    from fedadapt.strategies._records import state_from_records, state_to_records

    with pytest.raises(TypeError, match="'rule/x' is a list"):
        state_to_records({"rule": {"x": [1, 2]}}, "s")
    with pytest.raises(ValueError, match="no strategy state"):
        state_from_records(state_to_records({"a": 1}, "s"), "other")
    tree = {"a": {"b": None, "c": np.float32(1.5), "d": {}}, "e": True, "f": "x"}
    back = state_from_records(state_to_records(tree, "s"), "s")
    assert back["a"]["b"] is None and back["a"]["d"] == {}
    assert back["a"]["c"].dtype == np.float32 and back["a"]["c"] == 1.5
    assert back["e"] is True and back["f"] == "x"


# --- part 6: stop early -------------------------------------------------------------


def reference_stop(values, *, mode, target=None, patience=0, min_delta=0.0):
    """The round the rules stop after (None: all rounds), written out here."""
    best, waited = None, 0
    for r, v in enumerate(values, start=1):
        if best is None or (v > best + min_delta if mode == "max"
                            else v < best - min_delta):  # fmt: skip
            best, waited = v, 0
        else:
            waited += 1
        reached = target is not None and (v >= target if mode == "max" else v <= target)
        if (reached or (patience and waited >= patience)) and r < len(values):
            return r
    return None


def _series(result, phase, key):
    records = getattr(result, phase)
    return [records[r][key] for r in range(1, ROUNDS + 1)]


@pytest.mark.parametrize(
    ("stop", "phase", "key"),
    [
        ({"stop_metric": "accuracy", "stop_mode": "max"},
         "evaluate_metrics_serverapp", "accuracy"),
        ({"stop_metric": "eval-loss", "stop_mode": "min"},
         "evaluate_metrics_clientapp", "eval-loss"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("rule", ["target", "patience"])
def test_message_api_stop_rules_end_the_run_where_the_reference_says(
    stop, phase, key, rule
):
    whole = _message_run(_message_strategy("fedexp"), num_rounds=ROUNDS)
    values = _series(whole, phase, key)
    if rule == "target":
        extra = {"stop_target": values[2]}  # reached in round 3 at the latest
    else:  # every change after round 1 is smaller than min_delta
        extra = {"stop_patience": 2, "stop_min_delta": 1e9}
    want = reference_stop(values, mode=stop["stop_mode"],
                          target=extra.get("stop_target"),
                          patience=extra.get("stop_patience", 0),
                          min_delta=extra.get("stop_min_delta", 0.0))  # fmt: skip
    assert want is not None and want < ROUNDS
    strategy = _message_strategy("fedexp", **stop, **extra)
    grid = FakeGrid()
    result = _message_run(strategy, num_rounds=ROUNDS, grid=grid)
    assert sorted(result.train_metrics_clientapp) == list(range(1, want + 1))
    assert grid.train_calls == want * NUM_CLIENTS
    assert strategy.stop_reason == f"stop-{rule}"
    assert key in strategy.stop_message
    # the run returns round `want`'s model, the one whose metrics it reported
    short = _message_run(_message_strategy("fedexp"), num_rounds=want)
    for k in NAMES:
        assert _numpy(result.arrays)[k].tobytes() == _numpy(short.arrays)[k].tobytes()


def test_message_api_should_stop_as_in_flowers_nightly():
    """``start(..., should_stop)`` (Flower nightly's 8th argument) ends the loop."""
    strategy = _message_strategy("feddua")
    calls = []

    def should_stop(server_round, result):
        calls.append((server_round, sorted(result.train_metrics_clientapp)))
        return server_round == 2

    result = strategy.start(FakeGrid(), _record(X0), ROUNDS, 3600, None, None,
                            _evaluate_fn, should_stop)  # fmt: skip
    assert calls == [(1, [1]), (2, [1, 2])]
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    # the run did not run all its rounds: says so, naming the user's predicate
    assert strategy.stop_reason == "should-stop"
    assert "round 2" in strategy.stop_message


def test_a_rule_that_fires_in_the_last_round_is_no_early_stop():
    strategy = _message_strategy(
        "fedexp", stop_metric="loss", stop_mode="min", stop_patience=ROUNDS - 1,
        stop_min_delta=1e9,
    )  # fmt: skip
    result = _message_run(strategy, num_rounds=ROUNDS)
    assert strategy.stop_rule.waited == ROUNDS - 1  # it fired in round ROUNDS
    assert len(result.train_metrics_clientapp) == ROUNDS
    assert strategy.stop_reason is None


@pytest.mark.parametrize("rule", ["target", "patience"])
def test_legacy_api_stop_rules_end_the_run_where_the_reference_says(rule):
    _, whole, _ = _legacy_run(_legacy_strategy("fedexp"), ROUNDS)
    values = [m for _, m in whole.metrics_centralized["accuracy"][1:]]
    extra = (
        {"stop_target": values[2]} if rule == "target"
        else {"stop_patience": 2, "stop_min_delta": 1e9}
    )  # fmt: skip
    want = reference_stop(values, mode="max", target=extra.get("stop_target"),
                          patience=extra.get("stop_patience", 0),
                          min_delta=extra.get("stop_min_delta", 0.0))  # fmt: skip
    assert want is not None and want < ROUNDS
    strategy = _legacy_strategy("fedexp", stop_metric="accuracy", **extra)
    model, history, proxies = _legacy_run(strategy, ROUNDS)
    assert strategy.stop_reason == f"stop-{rule}"
    assert all(p.fit_calls == want for p in proxies)  # later rounds did nothing
    assert [r for r, _ in history.losses_centralized] == list(range(want + 1))
    short, _, _ = _legacy_run(_legacy_strategy("fedexp"), want)
    for k in NAMES:
        assert model[k].tobytes() == short[k].tobytes()


def test_stop_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match="need a stop_metric"):
        FedDuA(stop_target=0.9)
    with pytest.raises(ValueError, match="needs stop_target or stop_patience"):
        FedDuA(stop_metric="accuracy")
    with pytest.raises(ValueError, match="Invalid stop_mode"):
        legacy.FedExP(stop_metric="loss", stop_mode="lower", stop_patience=1)


def _recording_server(folder, strategy):
    """The legacy app's RecordingServer over the fake clients, writing to ``folder``."""
    from fedadapt.config import validate_run_config
    from fedadapt.server.legacy_app import RecordingServer
    from fedadapt.server.results import RunRecorder

    recorder = RunRecorder(folder, validate_run_config({}), 1)
    manager = SimpleClientManager()
    for i in range(NUM_CLIENTS):
        manager.register(FakeProxy(i))
    return RecordingServer(client_manager=manager, strategy=strategy,
                           recorder=recorder, array_names=NAMES)  # fmt: skip


@pytest.mark.app  # the legacy app / the README's Net need PyTorch
def test_the_legacy_app_records_why_the_run_ended(tmp_path):
    """Its RecordingServer writes stop_reason into results.json (no Ray needed)."""
    import json

    for name, stop in (("stopped", {"stop_metric": "accuracy", "stop_target": 0.0}),
                       ("whole", {})):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        strategy = _legacy_strategy("fedexp", **stop)
        _recording_server(folder, strategy).fit(3, timeout=None)
    stopped = json.loads((tmp_path / "stopped" / "results.json").read_text())
    assert stopped["status"] == "completed"
    assert stopped["stop_reason"] == "stop-target"
    assert "reached stop target 0 in round 1" in stopped["stop_detail"]
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert whole["stop_reason"] == "num-server-rounds"
    assert "stop_detail" not in whole


@pytest.mark.app  # the legacy app needs PyTorch
@pytest.mark.parametrize(
    ("name", "stop", "last_round"),
    [("feddua", {}, 3), ("fedexp", {}, 3),
     ("fedexp", {"stop_metric": "accuracy", "stop_target": 0.0}, 1)],
)  # fmt: skip
def test_the_legacy_app_saves_the_model_it_reported(name, stop, last_round, tmp_path):
    """final_model.npz: the legacy app's last evaluated model (not w_{t+1})."""
    history, _ = _recording_server(tmp_path, _legacy_strategy(name, **stop)).fit(
        3, timeout=None
    )
    with np.load(tmp_path / "final_model.npz") as saved:
        model = dict(saved)
    assert list(model) == NAMES
    assert history.losses_centralized[-1] == (last_round, score(model)["loss"])
    # the clients' own evaluation of the saved model, as Flower aggregates it
    n = [10 * (i + 1) for i in range(NUM_CLIENTS)]
    fed = sum(w * client_score(i, model) for i, w in enumerate(n)) / sum(n)
    assert history.losses_distributed[-1][0] == last_round
    assert history.losses_distributed[-1][1] == pytest.approx(fed, rel=1e-12)
    # written atomically: no temporary file left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "final_model.npz", "results.json"
    ]  # fmt: skip


def _readme_block(section: str) -> str:
    import re

    from tests.helpers import ROOT

    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text.split(section, 1)[1], re.S)
    assert code is not None, f"the README section {section!r} lost its example"
    return code.group(1)


class _Net:
    """The user's model of the README example: a torch module named w, b."""

    def state_dict(self):
        import torch

        return {k: torch.from_numpy(v.copy()) for k, v in X0.items()}


@pytest.mark.app  # the legacy app / the README's Net need PyTorch
def test_readme_resume_example_runs_as_written(tmp_path, monkeypatch):
    """2 rounds, then a second run to 4 == one run of 4 rounds, bit for bit."""
    from flwr.app import Context

    code = compile(_readme_block("### Resuming from Flower records"), "README", "exec")
    saved = {}
    for name, runs in (("split", (2, 4)), ("whole", (4,))):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        namespace = {"Net": _Net}
        exec(code, namespace)
        for rounds in runs:
            context = Context(1, 0, {}, RecordDict(), {"num-server-rounds": rounds})
            namespace["main"](FakeGrid(), context)
        saved[name] = records_from_bytes((folder / "feddua-state.bin").read_bytes())
        assert not (folder / "feddua-state.tmp").exists()
    split, whole = (saved[k].array_records["model"] for k in ("split", "whole"))
    assert list(split) == NAMES
    for k in NAMES:
        assert split[k].numpy().tobytes() == whole[k].numpy().tobytes()
    values = saved["split"].config_records["fedadapt-strategy.values"]
    assert values["round"] == 4


def test_readme_stop_example_builds():
    namespace = {"FedDuA": FedDuA}
    exec(compile(_readme_block("### Stopping early"), "README", "exec"), namespace)
    assert namespace["strategy"].stop_rule.patience == 5


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_a_stop_metric_never_reported_is_logged_once(api, caplog):
    stop = {"stop_metric": "acuracy", "stop_patience": 1}  # a typo
    if api == "message":
        _message_run(_message_strategy("fedexp", **stop), num_rounds=3)
    else:
        _legacy_run(_legacy_strategy("fedexp", **stop), 3)
    assert caplog.text.count("stop metric 'acuracy' was not reported") == 1
    assert "in round 1;" in caplog.text
