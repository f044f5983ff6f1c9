"""Issue #38 part 3: Krum, multi-Krum, Bulyan and centered clipping.

Oracles: Flower's own ``Krum`` / ``MultiKrum`` / ``Bulyan`` (both APIs) for
the FedAvg case, driven through the harness of ``test_hostile.py``; for
centered clipping a step-by-step float64 reference written here and closed
forms (equal updates, one far outlier); hand-computed A and fallbacks.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.server import strategy as flwr_legacy
from flwr.serverapp import strategy as flwr_message
from flwr.serverapp.strategy.multikrum import select_multikrum

from fedadapt import strategies as ours
from fedadapt.config import validate_run_config
from fedadapt.errors import ConfigError
from fedadapt.server.client_records import flatten
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.strategies import legacy
from fedadapt.strategies.core import FedAvgRule, FedExPRule
from fedadapt.strategies.core.aggregation import round_statistics
from fedadapt.strategies.core.robust import RobustOptions
from tests.strategies.test_hostile import FACTOR, _honest, _multi_step

pytestmark = pytest.mark.usefixtures("task_identity")

N = 7  # Bulyan with f = 1 needs 4f + 3 = 7 replies
HOSTILE = 3


def _clients(hostile, num=N, seed=11):
    """Float arrays of ``num`` honest clients; ``hostile``: one sends x1e6."""
    x0, clients = _honest(seed, num)
    x0 = {k: v for k, v in x0.items() if v.dtype.kind == "f"}
    clients = [{k: c[k] for k in x0} for c in clients]
    if hostile:
        clients[HOSTILE] = {k: x0[k] + FACTOR * (v - x0[k])
                            for k, v in clients[HOSTILE].items()}  # fmt: skip
    return x0, clients


def _iterated_krum(contents, num_malicious, theta):
    """Bulyan's selection as the paper (and Flower's legacy Bulyan): Krum θ
    times, each over the replies not yet chosen, with Flower's own Krum.

    Flower 1.42's Message-API ``Bulyan`` selects by default the θ best
    scores of one multi-Krum pass instead; on this test's honest round that
    keeps another update (client 6 instead of 1), so it is given the
    paper's selection here (its ``selection_rule``).
    """
    remaining, chosen = list(contents), []
    for _ in range(theta):
        best = select_multikrum(remaining, num_malicious, 1)[0]
        chosen.append(best)
        remaining = [c for c in remaining if c is not best]
    return chosen


def _flower(aggregation, api, f, keep):
    """Flower's strategy for ``aggregation`` (f hostile, multi-Krum keeps ``keep``)."""
    if api == "message":
        if aggregation == "bulyan":
            return flwr_message.Bulyan(
                num_malicious_nodes=f, selection_rule=_iterated_krum
            )
        return flwr_message.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=keep)
    if aggregation == "bulyan":
        return flwr_legacy.Bulyan(num_malicious_clients=f, to_keep=0)
    # legacy Krum: num_clients_to_keep = 0 is Krum, m > 0 multi-Krum
    return flwr_legacy.Krum(
        num_malicious_clients=f, num_clients_to_keep=0 if keep == 1 else keep
    )


# aggregation, f, krum_keep (ours), the m Flower is given
CASES = [
    ("krum", 1, 0, 1),
    ("krum", 2, 0, 1),
    ("multi_krum", 1, 0, N - 1),  # 0 = n − f
    ("multi_krum", 1, 3, 3),
    ("multi_krum", 2, 4, 4),
    ("bulyan", 1, 0, 0),
]


@pytest.mark.parametrize("hostile", [False, True])
@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize("aggregation, f, keep, flower_keep", CASES)
def test_selection_equals_flowers_krum_multikrum_and_bulyan(
    aggregation, f, keep, flower_keep, api, hostile
):
    # Prepare: FedAvg (step 1) with the aggregator; clipping off with the
    # hostile client (Flower's strategies do not clip); weights 10 + i
    x0, clients = _clients(hostile)
    module = ours if api == "message" else legacy
    ratio = {"max_update_norm_ratio": 0.0} if hostile else {}
    strategy = module.FedAvg(
        aggregation=aggregation, num_hostile=f, krum_keep=keep, **ratio
    )
    flower = _flower(aggregation, api, f, flower_keep)
    # Execute
    got = _multi_step(api, strategy, 1, x0, clients)
    want = _multi_step(api, flower, 1, x0, clients)
    # Assert: equal up to the rounding of x_t + (x_i − x_t) in float32
    for key in x0:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6)
        assert np.abs(got[key] - x0[key]).max() < 1  # the outlier stayed out
    report = strategy.round_reports[1]
    selected = [r["selected"] for r in report["clients"]]
    kept = {"krum": 1, "multi_krum": flower_keep, "bulyan": N - 2 * f}[aggregation]
    assert sum(selected) == kept
    assert report["diagnostics"]["excluded"] == N - kept
    assert report["diagnostics"]["hostile-assumed"] == f
    if hostile:
        assert selected[HOSTILE] is False
    assert all(r["center_clip_scale"] is None for r in report["clients"])


def _hand_clients(deltas, x0):
    return [{"w": x0 + np.asarray(d, dtype=float)} for d in deltas]


#: five honest updates near (1, 1) and one far one (index 5)
HAND = [[1.0, 1.0], [1.1, 0.9], [0.9, 1.2], [1.2, 1.0], [1.0, 0.8], [40.0, -30.0]]


@pytest.mark.parametrize(
    "aggregation, keep",
    [("krum", 0), ("multi_krum", 0), ("multi_krum", 2), ("bulyan", 0)],
)
def test_a_is_the_mean_sq_norm_of_the_selected_updates(aggregation, keep):
    # Prepare: FedExP (uniform) with f = 1 over six hand updates
    x0 = np.array([0.5, -2.0])
    deltas = np.array(HAND)
    options = RobustOptions(num_hostile=1, krum_keep=keep)
    # Execute
    stats = round_statistics(FedExPRule(), {"w": x0}, _hand_clients(HAND, x0),
                             [1] * 6, aggregation=aggregation,
                             robust_options=options)  # fmt: skip
    # Assert: the selection by hand (Krum scores over n − f − 2 = 3 nearest)
    dist = ((deltas[:, None] - deltas[None]) ** 2).sum(axis=2)
    scores = [np.sort(np.delete(dist[i], i))[:3].sum() for i in range(6)]
    order = list(np.argsort(scores))
    if aggregation == "bulyan":
        assert len(HAND) < 4 * 1 + 3  # six replies: f = 0 this round
    else:
        m = {"krum": 1, "multi_krum": keep or 5}[aggregation]
        chosen = order[:m]
        assert stats.defence.selected == tuple(i in chosen for i in range(6))
        sq = (deltas[chosen] ** 2).sum(axis=1)
        assert stats.mean_sq_norm == pytest.approx(float(sq.mean()), rel=1e-12)
        np.testing.assert_allclose(stats.mean_update["w"],
                                   deltas[chosen].mean(axis=0), rtol=1e-12)  # fmt: skip
    assert stats.defence.selected[5] is (aggregation == "bulyan")


def test_bulyan_a_and_coordinates_by_hand():
    # Prepare: seven updates (f = 1: θ = 5 selected, β = 3 per coordinate)
    deltas = np.array([*HAND, [0.95, 1.05]])
    x0 = np.zeros(2)
    # Execute
    stats = round_statistics(FedExPRule(), {"w": x0}, _hand_clients(deltas, x0),
                             [1] * 7, aggregation="bulyan")  # fmt: skip
    # Assert: Krum winners one by one over the remaining updates
    remaining, chosen = list(range(7)), []
    for _ in range(5):
        sub = deltas[remaining]
        dist = ((sub[:, None] - sub[None]) ** 2).sum(axis=2)
        closest = max(1, len(remaining) - 1 - 2)
        scores = [np.sort(np.delete(dist[i], i))[:closest].sum()
                  for i in range(len(remaining))]  # fmt: skip
        chosen.append(remaining.pop(int(np.argmin(scores))))
    picked = deltas[chosen]
    median = np.median(picked, axis=0)
    want = [np.sort(picked[np.argsort(np.abs(picked[:, j] - median[j]))[:3], j]).mean()
            for j in range(2)]  # fmt: skip
    np.testing.assert_allclose(stats.mean_update["w"], want, rtol=1e-12)
    assert stats.mean_sq_norm == pytest.approx((picked**2).sum(axis=1).mean())
    assert 5 not in chosen and stats.defence.selected[5] is False


# --- too few replies: no crash, the largest f the round allows ------------------


@pytest.mark.parametrize(
    "aggregation, n, f_used",
    [
        ("krum", 4, 0),  # f = 1 needs 5
        ("multi_krum", 6, 1),
        ("bulyan", 6, 0),  # f = 1 needs 7
        ("bulyan", 3, 0),
    ],
)
def test_too_few_replies_fall_back_to_a_smaller_f(aggregation, n, f_used, caplog):
    x0, clients = _clients(False, num=n)
    strategy = ours.FedAvg(aggregation=aggregation, num_hostile=1)
    with caplog.at_level(logging.WARNING):
        _multi_step("message", strategy, 1, x0, clients)
    report = strategy.round_reports[1]
    assert report["diagnostics"]["hostile-assumed"] == f_used
    if f_used < 1:
        assert f"{aggregation}: {n} replies, fewer than" in caplog.text


@pytest.mark.parametrize("api", ["message", "legacy"])
@pytest.mark.parametrize("aggregation", ["krum", "multi_krum", "bulyan"])
@pytest.mark.parametrize("n", [1, 2])
def test_under_three_replies_take_the_coordinate_wise_median(aggregation, n, api):
    x0, clients = _clients(False, num=n)
    module = ours if api == "message" else legacy
    strategy = module.FedAvg(aggregation=aggregation)
    got = _multi_step(api, strategy, 1, x0, clients)
    for key in x0:  # one reply: itself; two: their mean
        want = np.mean([c[key] for c in clients], axis=0)
        np.testing.assert_allclose(got[key], want, rtol=1e-6, atol=1e-7)
    assert strategy.round_reports[1]["diagnostics"]["excluded"] == 0


# --- centered clipping -----------------------------------------------------------


def _reference_cc(deltas, center, tau, iterations):
    """Karimireddy et al. 2021 eq. (CC), one client at a time, in float64.

    Returns v_L, the last factors and A (mean ‖v_{L−1} + c_i(Δ_i − v_{L−1})‖²).
    """
    v = np.array(center, dtype=np.float64)
    for _ in range(iterations):
        dists = [np.linalg.norm(d - v) for d in deltas]
        radius = tau if tau > 0 else float(np.median(dists))
        factors = [1.0 if r <= radius else radius / r for r in dists]
        effective = [v + c * (d - v) for c, d in zip(factors, deltas, strict=True)]
        a = float(np.mean([e @ e for e in effective]))
        v = v + sum(c * (d - v) for c, d in zip(factors, deltas, strict=True)) / len(
            deltas
        )
    return v, factors, a


def _split(flat):
    return {"a": flat[:3].reshape(3), "b": flat[3:].reshape(2, 2)}


@pytest.mark.parametrize("tau", [0.0, 0.3, 2.0])
@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("with_center", [False, True])
def test_centered_clipping_equals_a_step_by_step_reference(
    tau, iterations, with_center
):
    # Prepare: six updates over two arrays (the norm runs over both), one far
    rng = np.random.default_rng(3)
    deltas = rng.normal(size=(6, 7))
    deltas[2] += 25.0
    center = rng.normal(size=7) * 0.5 if with_center else np.zeros(7)
    x0 = {"a": rng.normal(size=3), "b": rng.normal(size=(2, 2))}
    clients = [{k: x0[k] + v for k, v in _split(d).items()} for d in deltas]
    # Execute
    stats = round_statistics(
        FedExPRule(), x0, clients, [1] * 6,
        aggregation="centered_clipping",
        robust_options=RobustOptions(clip_radius=tau, clip_iterations=iterations),
        center=_split(center) if with_center else None,
    )  # fmt: skip
    # Assert
    want, factors, a = _reference_cc(list(deltas), center, tau, iterations)
    for key, value in _split(want).items():
        np.testing.assert_allclose(stats.mean_update[key], value, rtol=1e-12)
    np.testing.assert_allclose(stats.defence.center_scales, factors, rtol=1e-12)
    assert stats.mean_sq_norm == pytest.approx(a, rel=1e-12)
    assert stats.defence.center_scales[2] < 1  # the far one was clipped


def test_centered_clipping_of_equal_updates_is_exact():
    # every update d: from zero with an adaptive or a large τ one iteration
    # lands on d, and from the centre d nothing moves, whatever τ
    x0 = np.array([1.0, -1.0, 0.5])
    clients = _hand_clients([[0.3, -0.2, 0.7]] * 5, x0)
    d = clients[0]["w"] - x0  # Δ_i as the server forms it
    for tau, center in ((0.0, None), (10.0, None), (0.01, {"w": d})):
        stats = round_statistics(
            FedAvgRule(weighting="uniform"), {"w": x0}, clients, [1] * 5,
            aggregation="centered_clipping",
            robust_options=RobustOptions(clip_radius=tau), center=center,
        )  # fmt: skip
        np.testing.assert_allclose(stats.mean_update["w"], d, rtol=1e-15)
        assert stats.defence.center_scales == (1.0,) * 5


@pytest.mark.parametrize("iterations", [1, 4])
def test_one_far_outlier_moves_the_result_by_at_most_tau_over_n(iterations):
    # honest updates all d, the centre already d; the outlier 1e6 away
    x0 = np.zeros(3)
    d = np.array([0.3, -0.2, 0.7])
    far = d + 1e6 * np.array([0.6, 0.0, 0.8])
    clients = _hand_clients([d, d, far, d, d], x0)
    tau, n = 0.5, 5
    stats = round_statistics(
        FedAvgRule(weighting="uniform"), {"w": x0}, clients, [1] * n,
        aggregation="centered_clipping", center={"w": d},
        robust_options=RobustOptions(clip_radius=tau, clip_iterations=iterations),
    )  # fmt: skip
    moved = np.linalg.norm(stats.mean_update["w"] - d)
    # one iteration: exactly τ/n towards the outlier; later ones: the honest
    # clients pull back, the fixed point is τ/(n − 1) away
    if iterations == 1:
        assert moved == pytest.approx(tau / n, rel=1e-9)
    assert tau / n * (1 - 1e-12) <= moved <= tau / (n - 1) * (1 + 1e-12)
    # adaptive τ: the median distance is 0, so the outlier is cut to nothing
    adaptive = round_statistics(
        FedAvgRule(weighting="uniform"), {"w": x0}, clients, [1] * n,
        aggregation="centered_clipping", center={"w": d},
    )  # fmt: skip
    np.testing.assert_array_equal(adaptive.mean_update["w"], d)
    assert adaptive.defence.center_scales[2] == 0.0


def _cc_rounds(api, strategy, rounds, seed=0):
    x = None
    for server_round in rounds:
        x0, clients = _clients(True, seed=seed + server_round)
        x = _multi_step(api, strategy, server_round, x0, clients)
    return x


@pytest.mark.parametrize("api", ["message", "legacy"])
def test_centered_clipping_keeps_its_centre_across_rounds_and_checkpoints(api):
    # Prepare
    module = ours if api == "message" else legacy
    # centered clipping alone (the norm ceiling would clip the hostile
    # update of round 2 before it does)
    options = {"aggregation": "centered_clipping", "clip_radius": 0.05,
               "max_update_norm_ratio": 0.0,
               "max_update_norm_growth": 0.0}  # fmt: skip
    strategy = module.FedAvg(**options)
    # Execute: round 1, then save; round 2 with and without the saved centre
    x1 = _cc_rounds(api, strategy, [1])
    x0, _ = _clients(True, seed=1)
    center = list(strategy.aggregator_state.center.values())  # legacy: "0", "1"
    for key, value in zip(x0, center, strict=True):  # FedAvg: x_1 = x_0 + Δ̄
        np.testing.assert_allclose(value, x1[key] - x0[key], atol=1e-7)
    saved = strategy.state_dict()
    resumed, fresh = module.FedAvg(**options), module.FedAvg(**options)
    resumed.load_state_dict(saved)
    want = _cc_rounds(api, strategy, [2])
    got = _cc_rounds(api, resumed, [2])
    cold = _cc_rounds(api, fresh, [2])
    # Assert: the resumed strategy continues exactly; a fresh one differs
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
        assert not np.allclose(cold[key], want[key])
    records = strategy.round_reports[2]["clients"]
    scales = [r["center_clip_scale"] for r in records]
    assert all(0 < s <= 1 for s in scales) and scales[HOSTILE] < 1e-3
    assert all(r["selected"] is None for r in records)
    line = flatten(records[HOSTILE])
    assert line["center_clip_scale"] == scales[HOSTILE] and line["selected"] is None
    diagnostics = strategy.round_reports[2]["diagnostics"]
    assert diagnostics["center-clip-radius"] == pytest.approx(0.05)
    assert diagnostics["center-clipped"] >= 1


def test_centered_clipping_centre_travels_in_flower_records():
    options = {"aggregation": "centered_clipping", "max_update_norm_ratio": 0.0}
    strategy = ours.FedAvg(**options)
    _cc_rounds("message", strategy, [1])
    resumed = ours.FedAvg(**options)
    resumed.load_state_records(strategy.state_to_records())
    for key, value in strategy.aggregator_state.center.items():
        np.testing.assert_array_equal(resumed.aggregator_state.center[key], value)


def test_a_centre_that_does_not_fit_the_model_restarts_from_zero(caplog):
    strategy = ours.FedAvg(aggregation="centered_clipping")
    strategy.aggregator_state.center = {"other": np.zeros(2)}
    with caplog.at_level(logging.WARNING):
        _cc_rounds("message", strategy, [1])
    assert "saved centre does not match" in caplog.text


# --- options: validation, secure aggregation, run config --------------------------


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"num_hostile": -1}, "num_hostile"),
        ({"num_hostile": 1.5}, "num_hostile"),
        ({"krum_keep": -2}, "krum_keep"),
        ({"clip_radius": -0.1}, "clip_radius"),
        ({"clip_radius": float("nan")}, "clip_radius"),
        ({"clip_iterations": 0}, "clip_iterations"),
        ({"aggregation": "multi-krum"}, "aggregation"),  # Python spells it multi_krum
        ({"secure_aggregation": True, "aggregation": "krum"}, "secure_agg"),
        ({"secure_aggregation": True, "aggregation": "centered_clipping"}, "secure"),
    ],
)
def test_invalid_options_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ours.FedDuA(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        legacy.FedDuA(**kwargs)


def test_run_config_keys_reach_both_apis():
    cfg = validate_run_config(
        {
            "strategy": "fedexp",
            "aggregation": "multi-krum",
            "num-hostile": 2,
            "krum-keep": 3,
            "clip-radius": 0.5,
            "clip-iterations": 2,
        }
    )
    for strategy in (build_strategy(cfg, num_nodes=7),
                     build_strategy(cfg, api="legacy")):  # fmt: skip
        assert strategy.aggregation == "multi_krum"
        assert strategy.robust_options == RobustOptions(2, 3, 0.5, 2)
    for name in ("krum", "bulyan", "centered-clipping"):
        cfg = validate_run_config({"aggregation": name})
        assert build_strategy(cfg, num_nodes=7).aggregation == name.replace("-", "_")


@pytest.mark.parametrize(
    "config, key",
    [
        ({"secure-aggregation": True, "aggregation": "krum"}, "aggregation"),
        ({"secure-aggregation": True, "aggregation": "centered-clipping"},
         "aggregation"),
        ({"num-hostile": -1}, "num-hostile"),
        ({"clip-iterations": 0}, "clip-iterations"),
        ({"clip-radius": -1.0}, "clip-radius"),
        # a round of 5 can never hold Bulyan's 4f + 3 = 7
        ({"aggregation": "bulyan", "clients-per-round": 5}, "num-hostile"),
        ({"aggregation": "krum", "clients-per-round": 6, "num-hostile": 2},
         "num-hostile"),
        ({"aggregation": "multi-krum", "clients-per-round": 6, "krum-keep": 6},
         "krum-keep"),
    ],
)  # fmt: skip
def test_impossible_run_configs_fail_at_start(config, key):
    with pytest.raises(ConfigError, match=key):
        validate_run_config(config)
