"""Reply screening in fedadapt.strategies.FedAvg against closed-form averages."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedadapt.strategies import FedAvg, reject_reason
from tests.helpers import make_reply

GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def _client(value, n=1, **metrics):
    arrays = {
        "w": np.full((2, 3), value, dtype=np.float32),
        "b": np.full(3, value, dtype=np.float32),
    }
    return arrays, {"num-examples": n, **metrics}


def _strategy():
    strategy = FedAvg()
    strategy._sent = {k: v.copy() for k, v in GLOBAL.items()}  # as configure_train does
    return strategy


def test_valid_replies_give_flowers_weighted_average():
    # Prepare: x_new = (1*1 + 3*3) / 4 = 2.5
    replies = [make_reply(*_client(1.0, n=1)), make_reply(*_client(3.0, n=3))]
    # Execute
    arrays, metrics = _strategy().aggregate_train(1, replies)
    expected, _ = FlowerFedAvg().aggregate_train(1, replies)
    # Assert
    np.testing.assert_allclose(arrays["w"].numpy(), 2.5)
    np.testing.assert_array_equal(arrays["w"].numpy(), expected["w"].numpy())


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (({"w": np.full((2, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)},
          {"num-examples": 5}), "NaN or Inf"),
        (({"w": np.full((2, 3), np.inf, np.float32), "b": np.zeros(3, np.float32)},
          {"num-examples": 5}), "NaN or Inf"),
        (({"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)},
          {"num-examples": 5}), "shape"),
        (({"w": np.zeros((2, 3), np.float64), "b": np.zeros(3, np.float32)},
          {"num-examples": 5}), "dtype"),
        (({"w": np.zeros((2, 3), np.float32)}, {"num-examples": 5}), "names differ"),
        (_client(9.0, n=0), "num-examples"),
        (_client(9.0, n=-2), "num-examples"),
        ((_client(9.0)[0], {"loss": 1.0}), "num-examples"),
        (_client(9.0, n=4, **{"update-sq-norm": -1.0}), "update-sq-norm"),
        (_client(9.0, n=4, **{"update-sq-norm": float("nan")}), "update-sq-norm"),
    ],
)  # fmt: skip
def test_bad_reply_is_dropped_counted_and_the_rest_averaged(bad, reason):
    # Prepare: one bad reply among two good ones (values 1 and 3, equal weights)
    replies = [
        make_reply(*_client(1.0, n=2), node_id=1),
        make_reply(*bad, node_id=2),
        make_reply(*_client(3.0, n=2), node_id=3),
    ]
    strategy = _strategy()
    # Execute
    arrays, _ = strategy.aggregate_train(4, replies)
    # Assert
    np.testing.assert_allclose(arrays["w"].numpy(), 2.0)
    np.testing.assert_allclose(arrays["b"].numpy(), 2.0)
    report = strategy.round_reports[4]["train_replies"]
    assert report["received"] == 3 and report["rejected"] == 1 and report["used"] == 2
    assert "node 2" in report["rejections"][0] and reason in report["rejections"][0]


def test_failed_replies_are_counted():
    replies = [make_reply(*_client(1.0)), make_reply(None, {}, node_id=7, error=True)]
    strategy = _strategy()
    arrays, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), 1.0)
    assert strategy.round_reports[1]["train_replies"]["failed"] == 1


def test_round_without_valid_replies_keeps_the_model():
    replies = [make_reply(*_client(np.nan)), make_reply(None, {}, error=True)]
    strategy = _strategy()
    assert strategy.aggregate_train(2, replies) == (None, None)
    report = strategy.round_reports[2]["train_replies"]
    assert (report["failed"], report["rejected"], report["used"]) == (1, 1, 0)
    assert strategy.aggregate_train(3, []) == (None, None)


def test_evaluate_replies_are_screened():
    strategy = _strategy()
    replies = [
        make_reply(None, {"num-examples": 10, "eval-loss": 1.0}),
        make_reply(None, {"num-examples": 30, "eval-loss": 3.0}),
        make_reply(None, {"num-examples": 0, "eval-loss": 99.0}),
    ]
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["eval-loss"] == pytest.approx(2.5)
    assert strategy.round_reports[1]["evaluate_replies"]["rejected"] == 1


def test_reject_reason_accepts_integer_arrays_without_finiteness_check():
    arrays = {"steps": np.array([3], dtype=np.int64)}
    assert reject_reason(arrays, {"num-examples": 1}, arrays, "num-examples") is None


# --- reading replies without copies (issue #20) --------------------------------


#: Layouts a serialised Array can carry: C and Fortran order, 0-d, empty,
#: big-endian, and (for serialising) a strided view.
ODD_ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.array(7, dtype=np.int64),
    np.zeros((0, 3), dtype=np.float16),
    np.arange(6, dtype=">f4").reshape(2, 3),
]


@pytest.mark.parametrize("array", ODD_ARRAYS)
def test_array_view_equals_flowers_numpy_and_is_read_only(array):
    """array_view gives what Array.numpy() gives (np.load), as a read-only view."""
    from flwr.app import Array

    from fedadapt.strategies.arrays import array_view

    item = Array(array)
    view, loaded = array_view(item), item.numpy()
    assert view.shape == loaded.shape and view.dtype == loaded.dtype
    np.testing.assert_array_equal(view, loaded)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[...] = 0


@pytest.mark.parametrize("cut", [1, 4])
def test_array_view_of_truncated_or_padded_bytes_fails_like_numpy(cut):
    """Data shorter than the header says raise as np.load does; extra bytes too."""
    from flwr.app import Array

    from fedadapt.strategies.arrays import array_view

    item = Array(np.arange(6.0))
    short = Array(item.dtype, item.shape, item.stype, item.data[:-cut])
    with pytest.raises(ValueError):
        array_view(short)
    padded = Array(item.dtype, item.shape, item.stype, item.data + b"\0" * cut)
    assert array_view(padded).shape == (6,)  # np.load's answer: trailing ignored


def test_reply_whose_header_contradicts_its_metadata_is_rejected():
    """The .npy header (what is read) must match the declared shape and dtype."""
    from flwr.app import Array

    global_arrays = {"w": np.zeros((2, 3), dtype=np.float32)}
    forged = Array(np.zeros(6, dtype=np.float32))  # header says (6,)
    lying = Array("float32", (2, 3), forged.stype, forged.data)
    honest = make_reply({"w": np.ones((2, 3), dtype=np.float32)}, {"num-examples": 10})
    liar = make_reply({"w": np.ones((2, 3), dtype=np.float32)}, {"num-examples": 9}, 2)
    next(iter(liar.content.array_records.values()))["w"] = lying
    strategy = FedAvg()
    strategy._sent = global_arrays
    arrays, _ = strategy.aggregate_train(1, [honest, liar])
    report = strategy.round_reports[1]["train_replies"]
    assert report["used"] == 1 and report["rejected"] == 1
    assert "do not match its metadata" in report["rejections"][0]
    np.testing.assert_array_equal(arrays["w"].numpy(), np.ones((2, 3)))


def _flower_reason(ex: BaseException) -> str:
    """The reason Flower 1.42 puts in a ClientApp's error reply (its own
    wording, run_clientapp.py: type, then message)."""
    return str(type(ex)) + ":<'" + str(ex) + "'>"


def test_a_nodes_data_error_is_one_line_naming_the_node_once():
    """#42: results.json showed ``<class '…NodeDataError'>:<'node 4711
    data-path …'>`` after ``node 4711:``; docs/deployment.md promises the
    node's own line."""
    from fedadapt.strategies.screening import failed_reply

    class NodeDataError(ValueError):  # the shape of fedadapt's (tasks layer)
        pass

    error = NodeDataError("node 4711 data-path /srv/x.npz: no such file or folder")
    assert (
        failed_reply(4711, _flower_reason(error))
        == "node 4711 data-path /srv/x.npz: no such file or folder"
    )
    # another exception: the node, then its type and message
    assert (
        failed_reply(7, _flower_reason(ZeroDivisionError("division by zero")))
        == "node 7: ZeroDivisionError: division by zero"
    )
    # a reason in any other wording is kept as it is
    assert failed_reply(7, "Message TTL expired") == "node 7: Message TTL expired"
