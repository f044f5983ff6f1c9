"""Server aggregation of Fed-LAMB / Fed-AMS second moments (arXiv:2110.00532).

Expected values are written out by hand or computed with plain NumPy in the
test (LAMB Alg. 1 lines 13–16: v̂_r = max(v̂_{r−1}, Σ ω_i v_i)).
"""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest

from fedadapt.strategies import fedlamb as _second_moments
from fedadapt.strategies.core import aggregate_second_moments


def _clients(rng, n, shapes, dtype=np.float64):
    return [
        {name: rng.random(shape).astype(dtype) for name, shape in shapes.items()}
        for _ in range(n)
    ]


SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,), "scalar": ()}


def test_hand_computed_max_of_prev_and_uniform_mean():
    # LAMB Alg. 1 line 16 with hand numbers: mean([2, 2], [4, 2]) = [3, 2].
    prev = {"w": np.array([1.0, 5.0])}
    clients = [{"w": np.array([2.0, 2.0])}, {"w": np.array([4.0, 2.0])}]
    out = aggregate_second_moments(prev, clients)
    np.testing.assert_array_equal(out["w"], [3.0, 5.0])


def test_uniform_mean_of_participants():
    # LAMB Alg. 1 lines 15-16 average uniformly (1/n) over all n devices; our
    # choice: uniform ω over the participants D^r of line 4 (here 3 of them).
    rng = np.random.default_rng(0)
    clients = _clients(rng, 3, SHAPES)
    prev = {k: np.zeros(s) for k, s in SHAPES.items()}
    out = aggregate_second_moments(prev, clients)
    assert list(out) == list(SHAPES)
    for k in SHAPES:
        expected = (clients[0][k] + clients[1][k] + clients[2][k]) / 3
        np.testing.assert_allclose(out[k], expected, rtol=1e-12)
        assert out[k].shape == SHAPES[k]


def test_round_one_uses_eps_floor():
    # LAMB Alg. 1 line 2: v̂_0 = ε·1.
    zeros = [{"w": np.zeros(4)}, {"w": np.zeros(4)}]
    out = aggregate_second_moments(None, zeros, eps=1e-3)
    np.testing.assert_array_equal(out["w"], np.full(4, 1e-3))
    big = [
        {"w": np.array([1.0, 0.0, 3.0, 1e-9])},
        {"w": np.array([3.0, 0.0, 1.0, 0.0])},
    ]
    out = aggregate_second_moments(None, big, eps=1e-8)
    np.testing.assert_allclose(out["w"], [2.0, 1e-8, 2.0, 1e-8], rtol=1e-12)


def test_monotone_over_rounds_and_equals_formula():
    # LAMB Alg. 1 line 16: v̂ never decreases; each round equals
    # max(v̂_{r−1}, mean v_i).
    rng = np.random.default_rng(1)
    v_hat = None
    expected = {k: np.full(s, 1e-8) for k, s in SHAPES.items()}
    for _ in range(4):
        clients = [
            {k: rng.random(s) * rng.choice([0.1, 1.0, 10.0]) for k, s in SHAPES.items()}
            for _ in range(int(rng.integers(1, 4)))
        ]
        new = aggregate_second_moments(v_hat, clients)
        for k in SHAPES:
            mean = sum(c[k] for c in clients) / len(clients)
            expected[k] = np.maximum(expected[k], mean)
            np.testing.assert_allclose(new[k], expected[k], rtol=1e-12)
            if v_hat is not None:
                assert np.all(new[k] >= v_hat[k])
        v_hat = new


def test_weighted_variant():
    clients = [{"w": np.array([1.0, 8.0])}, {"w": np.array([5.0, 0.0])}]
    prev = {"w": np.zeros(2)}
    out = aggregate_second_moments(prev, clients, weights=[1, 3])
    np.testing.assert_allclose(out["w"], [(1 + 15) / 4, 8 / 4], rtol=1e-12)
    # Weights are normalised: scaling them changes nothing.
    again = aggregate_second_moments(prev, clients, weights=[10.0, 30.0])
    np.testing.assert_allclose(again["w"], out["w"], rtol=1e-15)
    # A zero weight drops that client.
    only_first = aggregate_second_moments(prev, clients, weights=[2.0, 0.0])
    np.testing.assert_array_equal(only_first["w"], [1.0, 8.0])


def test_dtype_kept_inputs_untouched():
    rng = np.random.default_rng(2)
    clients = _clients(rng, 2, SHAPES, dtype=np.float32)
    prev = {k: np.full(s, 0.5, dtype=np.float32) for k, s in SHAPES.items()}
    copies = [{k: a.copy() for k, a in c.items()} for c in clients]
    prev_copy = {k: a.copy() for k, a in prev.items()}
    out = aggregate_second_moments(prev, clients)
    for k in SHAPES:
        assert out[k].dtype == np.float32
        assert np.all(out[k] >= prev[k])
        np.testing.assert_array_equal(prev[k], prev_copy[k])
        for c, cc in zip(clients, copies, strict=True):
            np.testing.assert_array_equal(c[k], cc[k])
        assert out[k] is not prev[k]


def _good():
    return {"a": np.ones((2, 2)), "b": np.ones(3)}


@pytest.mark.parametrize(
    ("prev", "clients", "kwargs", "match"),
    [
        (None, [], {}, "empty"),
        (None, [_good(), {"a": np.ones((2, 3)), "b": np.ones(3)}], {}, "shape"),
        (None, [_good(), {"a": np.ones((2, 2))}], {}, "names"),
        ({"a": np.ones((2, 2)), "b": np.ones(4)}, [_good()], {}, "shape"),
        ({"a": np.ones((2, 2))}, [_good()], {}, "names"),
        (
            None,
            [_good(), {"a": np.full((2, 2), np.nan), "b": np.ones(3)}],
            {},
            "finite",
        ),
        (None, [{"a": np.ones((2, 2)), "b": np.array([1.0, np.inf, 1.0])}], {}, "fin"),
        (None, [{"a": -np.ones((2, 2)), "b": np.ones(3)}], {}, "negative"),
        ({"a": np.ones((2, 2)), "b": np.array([1, -1e-3, 0.0])}, [_good()], {}, "neg"),
        ({"a": np.full((2, 2), np.nan), "b": np.ones(3)}, [_good()], {}, "finite"),
        (None, [{"a": np.ones((2, 2), dtype=int), "b": np.ones(3)}], {}, "dtype"),
        (
            None,
            [_good(), {"a": np.ones((2, 2), np.float32), "b": np.ones(3)}],
            {},
            "dt",
        ),
        (None, [_good(), _good()], {"weights": [1.0]}, "Invalid weights"),
        (None, [_good(), _good()], {"weights": [1.0, -1.0]}, r"Invalid weights\[1\]"),
        (None, [_good(), _good()], {"weights": [0.0, 0.0]}, "Invalid weights"),
        (None, [_good()], {"weights": [float("nan")]}, r"Invalid weights\[0\]"),
        (None, [_good()], {"eps": -1e-8}, "Invalid eps"),
    ],
)
def test_bad_inputs_raise(prev, clients, kwargs, match):
    with pytest.raises(ValueError, match=match):
        aggregate_second_moments(prev, clients, **kwargs)


def test_module_does_not_import_torch():
    tree = ast.parse(inspect.getsource(_second_moments))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported
