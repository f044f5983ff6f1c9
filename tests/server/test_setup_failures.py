"""Issue #26 parts 4-6: impossible set-ups fail at start, error texts name the
file / key / node and what to do, checkpoints are kept by default."""

from __future__ import annotations

import gzip
import json
import pickle
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.superlink.grid import InMemoryGrid

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.server import run as server_run
from fedadapt.server import server_app
from fedadapt.server.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from fedadapt.server.results import RunRecorder
from fedadapt.server.run import RoundHook
from fedadapt.strategies import FedAvg
from fedadapt.tasks import TASKS
from fedadapt.tasks.datasets import DatasetCorruptError, load_torchvision
from fedadapt.tools import cli
from tests.helpers import make_reply
from tests.tasks.test_datasets import make_mnist
from tests.tasks.test_tasks import write_mnist5k_csv

# digits-mlp: 1,797 digits, 20 % central test set -> 1,437 training samples
DIGITS_TRAIN = 1437

# ---------------------------------------------------------------------------
# Part 4: the federation size
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5"])
def test_cli_refuses_a_federation_without_nodes_before_starting_anything(
    value, capsys, monkeypatch
):
    started = Mock(side_effect=AssertionError("a SuperLink was started"))
    monkeypatch.setattr(cli, "SimulationSuperLink", started)
    with pytest.raises(SystemExit) as stop:
        cli.main(["simulate", "--num-supernodes", value])
    assert stop.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert "--num-supernodes" in err and "positive integer" in err
    started.assert_not_called()


def _one_line_error(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_more_nodes_than_dirichlet_can_feed_fails_naming_keys_and_fix(cfg):
    # dirichlet keeps >= 10 samples per client: 1,437 samples feed at most 143
    config = cfg(task="digits-mlp", partition="dirichlet")
    with pytest.raises(ConfigError) as error:
        server_run.check_partition(TASKS.get("digits-mlp"), config, 1000)
    text = _one_line_error(error)
    for needle in ("'partition'", "'digits-mlp'", "'dirichlet'", "1000 simulated",
                   "num-supernodes", f"from {DIGITS_TRAIN} samples",
                   "--num-supernodes N"):  # fmt: skip
        assert needle in text, (needle, text)
    server_run.check_partition(TASKS.get("digits-mlp"), config, 10)  # feasible


def test_iid_needs_one_training_sample_per_node(cfg):
    config = cfg(task="digits-mlp", partition="iid")
    with pytest.raises(ConfigError, match="num-supernodes"):
        server_run.check_partition(TASKS.get("digits-mlp"), config, DIGITS_TRAIN + 1)


def test_federated_evaluation_needs_a_local_test_split(cfg):
    # 359 or 360 samples per client: round(0.001 · 360) = 0 test samples each
    config = cfg(partition="iid", client_test_fraction=0.001, clients_per_eval=2)
    with pytest.raises(ConfigError) as error:
        server_run.check_partition(TASKS.get("digits-mlp"), config, 4)
    text = _one_line_error(error)
    assert "4 of 4 clients get no local test sample" in text
    assert "client-test-fraction" in text and "clients-per-eval=0" in text
    digits = TASKS.get("digits-mlp")
    server_run.check_partition(digits, {**config, "clients-per-eval": 0}, 4)
    server_run.check_partition(digits, {**config, "client-test-fraction": 0.01}, 4)


def test_shards_over_more_nodes_than_samples_fail_with_flowers_reason(cfg):
    config = cfg(partition="shards", classes_per_client=1)
    with pytest.raises(ConfigError) as error:
        server_run.check_partition(TASKS.get("digits-mlp"), config, DIGITS_TRAIN + 63)
    text = _one_line_error(error)
    assert "'shards'" in text and "1500 simulated nodes" in text
    assert "smaller than the number of samples" in text  # flwr-datasets' words


def _context(run_config: dict) -> Context:
    return Context(1, 0, {}, RecordDict(), dict(run_config))


def test_simulated_server_fails_before_round_one_on_an_impossible_split(tmp_path):
    """The ServerApp itself, with a simulated federation of 1000 nodes."""
    grid = Mock(spec=InMemoryGrid)
    grid.get_node_ids.return_value = list(range(1, 1001))
    context = _context({"output-dir": str(tmp_path), "num-server-rounds": 1})
    with pytest.raises(ConfigError, match="cannot feed 1000 simulated nodes"):
        server_app.main(grid, context)
    grid.send_and_receive.assert_not_called()
    grid.push_messages.assert_not_called()
    assert not any(tmp_path.iterdir())  # no run folder started


# ---------------------------------------------------------------------------
# Part 5: error texts name the file / key / node
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda b: b[: len(b) // 2], "bytes, but its header (20×28×28) needs"),
        (lambda b: b"\x01\x02" + b[2:], "bad magic number"),
    ],
)
def test_damaged_mnist_idx_file_is_named_with_data_dir(tmp_path, damage, problem):
    make_mnist(tmp_path)
    bad = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    bad.write_bytes(damage(bad.read_bytes()))
    with pytest.raises(DatasetCorruptError) as error:
        load_torchvision("mnist", tmp_path, train=True)
    text = str(error.value)
    assert f"{bad}: " in text and problem in text
    assert "data-dir" in text and "fetch them again" in text
    assert "train-labels" not in text  # the intact file is not blamed
    load_torchvision("mnist", tmp_path, train=False)  # the test split is intact


def test_damaged_mnist_reaches_the_run_as_a_named_error(tmp_path, cfg):
    make_mnist(tmp_path)
    bad = tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    bad.write_bytes(bad.read_bytes()[:-3])
    config = cfg(task="mnist-cnn", data_dir=str(tmp_path))
    with pytest.raises(DatasetCorruptError, match="t10k-labels-idx1-ubyte: 15 bytes"):
        TASKS.get("mnist-cnn").load_test(config)


def test_truncated_mnist5k_file_is_named_with_data_dir(tmp_path, cfg):
    file = tmp_path / "mnist_5k.csv.gz"
    write_mnist5k_csv(file)
    file.write_bytes(file.read_bytes()[:-40])  # cut inside the gzip stream
    with gzip.open(file, "rt") as handle, pytest.raises(EOFError):
        handle.read()  # the oracle: gzip itself says the stream is cut
    with pytest.raises(DatasetCorruptError) as error:
        TASKS.get("mnist5k-cnn").load_test(cfg(data_dir=str(tmp_path)))
    text = str(error.value)
    assert str(file) in text and "data-dir" in text and "EOFError" in text


def test_unwritable_output_dir_names_the_key_and_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    grid = Mock()  # a deployment with two connected nodes
    grid.get_node_ids.return_value = [1, 2]
    context = _context({"output-dir": str(blocker / "out"), "run-name": "r"})
    with pytest.raises(ConfigError) as error:
        server_app.main(grid, context)
    text = str(error.value)
    assert "'output-dir'" in text and str(blocker) in text and "writable" in text
    grid.push_messages.assert_not_called()


GLOBAL = {"w": np.zeros(3, dtype=np.float32)}


def test_dropped_node_is_recorded_with_its_id_and_reason(tmp_path, task_identity):
    """A node lost mid-round: Flower's SuperLink answers its message with a
    NODE_UNAVAILABLE error sent *from the SuperLink* (src node 1), linked to
    the message by ``reply_to_message_id``; results.json names the lost node
    and the reason."""
    from flwr.app import Array, ArrayRecord, ConfigRecord
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.linkstate.utils import (
        NODE_UNAVAILABLE_ERROR_REASON,
        create_message_error_unavailable_res_message,
    )

    strategy = FedAvg()
    grid = Mock()
    grid.get_node_ids.return_value = [42, 43]
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    sent = list(strategy.configure_train(1, arrays, ConfigRecord({}), grid))
    for i, message in enumerate(sent):  # what Grid.push_messages does
        message.metadata.__dict__["_message_id"] = f"message-{i}"
    to_42 = next(m for m in sent if m.metadata.dst_node_id == 42)
    lost = create_message_error_unavailable_res_message(to_42.metadata, "node")
    assert lost.metadata.src_node_id == SUPERLINK_NODE_ID  # not the lost node
    ok = make_reply({"w": np.ones(3, np.float32)}, {"num-examples": 1}, node_id=43)
    strategy.aggregate_train(1, [ok, lost])
    report = strategy.round_reports[1]
    expected = [f"node 42: {NODE_UNAVAILABLE_ERROR_REASON}"]
    assert report["train_replies"]["failed"] == 1
    assert report["train_replies"]["errors"] == expected
    recorder = RunRecorder(tmp_path, validate_run_config({}), run_id=5)
    recorder.record_round(1, 1, None, report)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rounds"][0]["replies"]["errors"] == expected


def test_legacy_failure_names_the_node():
    from flwr.common import Code, FitRes, Parameters, Status

    from fedadapt.strategies.legacy import FedAvg as LegacyFedAvg

    strategy = LegacyFedAvg()
    proxy = Mock(cid="7")
    res = FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "client gone"),
                 Parameters([], ""), 0, {})  # fmt: skip
    strategy.aggregate_fit(1, [], [(proxy, res), RuntimeError("timeout")])
    errors = strategy.round_reports[1]["train_replies"]["errors"]
    assert errors == ["node 7: client gone", "node ?: RuntimeError('timeout')"]


# ---------------------------------------------------------------------------
# Part 6: checkpoints by default, kept when a write fails, --resume
# ---------------------------------------------------------------------------


def test_runs_checkpoint_every_round_by_default():
    assert validate_run_config({})["checkpoint-every"] == 1


def _save(path, server_round, **results):
    return save_checkpoint(
        path, server_round, GLOBAL, {"rule": {}}, {"config": {}, **results}
    )


def test_failed_checkpoint_write_keeps_the_last_good_one(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT_FILE
    size = _save(path, 1)
    assert size == path.stat().st_size

    def disk_full(obj, file, protocol):
        file.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pickle, "dump", disk_full)
    with pytest.raises(OSError, match="No space"):
        _save(path, 2)
    monkeypatch.undo()
    assert pickle.loads(path.read_bytes())["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]  # no debris


def test_run_goes_on_and_records_a_failed_checkpoint(tmp_path, monkeypatch):
    config = validate_run_config({"num-server-rounds": 3})
    recorder = RunRecorder(tmp_path, config, run_id=1)
    strategy = Mock(round_reports={}, state_dict=dict)
    hook = RoundHook(
        config, TASKS.get("digits-mlp"), strategy, recorder,
        latest=lambda: GLOBAL, evaluate=lambda state: {"loss": 1.0},
    )  # fmt: skip
    hook(1, GLOBAL)
    good = (tmp_path / CHECKPOINT_FILE).read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fedadapt.server.run.save_checkpoint", full)
    hook(2, GLOBAL)  # no exception: the run goes on
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == good
    rounds = json.loads((tmp_path / "results.json").read_text())["rounds"]
    assert rounds[0]["checkpoint"]["bytes"] == len(good)
    assert "No space left on device" in rounds[1]["checkpoint"]["error"]


def test_resume_points_the_run_at_its_own_folder(tmp_path):
    run_dir = tmp_path / "out" / "my-run"
    run_dir.mkdir(parents=True)
    with pytest.raises(ValueError, match="cannot read the run config"):
        cli.resume_overrides(run_dir, {})
    saved = validate_run_config(
        {"strategy": "fedadam", "num-server-rounds": 4, "output-dir": "/elsewhere"}
    )
    (run_dir / "results.json").write_text(json.dumps({"config": saved}))
    with pytest.raises(ValueError, match="no checkpoint.pkl in that folder"):
        cli.resume_overrides(run_dir, {})
    _save(run_dir / CHECKPOINT_FILE, 2, config=saved)
    overrides = cli.resume_overrides(run_dir, {"num-server-rounds": 6})
    assert overrides == {
        **saved,
        "num-server-rounds": 6,
        "resume-from": str(run_dir / CHECKPOINT_FILE),
        "output-dir": str(tmp_path / "out"),
        "run-name": "my-run",
    }
    cfg = validate_run_config(overrides)
    assert load_checkpoint(cfg["resume-from"], cfg)["round"] == 2


@pytest.mark.parametrize("command", ["simulate", "deploy", "make-node-data"])
def test_an_unreadable_run_config_is_one_line_naming_the_option(
    command, capsys, monkeypatch
):
    """A string value without quotes is not TOML: Flower's parser raises
    click's exception, which used to end the command with a traceback."""
    started = Mock(side_effect=AssertionError("a SuperLink was started"))
    monkeypatch.setattr(cli, "SimulationSuperLink", started)
    extra = ["--num-nodes", "2", "--out", "x"] if command == "make-node-data" else []
    code = cli.main([command, *extra, "--run-config", "run-name=first"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--run-config 'run-name=first'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    started.assert_not_called()
