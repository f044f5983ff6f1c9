"""The attack suite (benchmarks/attacks.py) runs and measures what it says.

The suite is a benchmark, not a test; these cases run its least-squares
harness level on a tiny grid so that a change to the aggregation path's
signature cannot break it silently (it did once: a secure-aggregation mode
string was read as True, and every cell raised).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.app  # the suite imports the run config (app side)


def _suite():
    spec = importlib.util.spec_from_file_location(
        "attack_suite", ROOT / "benchmarks" / "attacks.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["attack_suite"] = module
    spec.loader.exec_module(module)
    return module


def _grid(suite, defences: list[str], attacks: list[str]) -> dict:
    args = argparse.Namespace(
        level="harness", task=None, rounds=5, seeds=1,
        strategies=["fedavg", "fedexp"], defences=defences,
        attacks=attacks, hostile=[1],
    )  # fmt: skip
    return suite.run_grid(args)


def test_harness_grid_runs_and_an_undefended_attack_moves_the_model() -> None:
    suite = _suite()
    doc = _grid(suite, ["default", "off"], ["ipm"])
    cells = {(c["defence"], c["strategy"], c["attack"]): c for c in doc["cells"]}
    assert len(cells) == 2 * 2 * 2  # defences × strategies × (honest, ipm)
    for cell in cells.values():
        assert cell["metric"] == cell["metric"]  # finite, not NaN
    # oracle: the honest run is its own reference (distance 0); an attack
    # with no defence moves FedAvg's model away from it
    assert cells[("off", "fedavg", "none")]["distance"] == 0.0
    assert cells[("off", "fedavg", "ipm")]["distance"] > 0.05


def test_default_defence_uses_the_servers_own_norms() -> None:
    """A false norm report changes nothing under the default (issue #38)."""
    suite = _suite()
    doc = _grid(suite, ["default"], ["false-norm"])
    lied = [c for c in doc["cells"] if c["attack"] == "false-norm"]
    assert lied and all(c["norm-mismatches"] > 0 for c in lied)
    assert all(c["distance"] == 0.0 for c in lied)


def test_under_secagg_the_rotation_bounds_what_one_client_can_reverse():
    """Issue #38 item 4: the Jensen-slack attack against SecAgg+ (sums only).

    One client claims the largest norm its entry allows and sends the update
    that turns Δ̄ around within A ≥ ‖Δ̄‖². Without the rotated block nothing
    bounds its size and it drives FedAvg's model far away (measured: the
    loss ×375 in 10 rounds); with it (κ = 2) every reply is within κ·B and
    the same attack moves the model a fraction of that. No round is refused
    either way: the sums are consistent, which is the attack's point.
    """
    suite = _suite()
    doc = _grid(suite, ["secagg+", "secagg+-unrotated"], ["slack-reverse"])
    cells = {(c["defence"], c["strategy"], c["attack"]): c for c in doc["cells"]}
    for defence in ("secagg+", "secagg+-unrotated"):
        cell = cells[(defence, "fedavg", "slack-reverse")]
        assert cell["refused-rounds"] == 0
        assert cell["distance"] > 0.05
    bounded = cells[("secagg+", "fedavg", "slack-reverse")]["distance"]
    unbounded = cells[("secagg+-unrotated", "fedavg", "slack-reverse")]["distance"]
    assert unbounded > 5 * bounded


def test_the_attacker_that_knows_the_screen_pushes_to_its_edge():
    """The suite's attacker rehearses the server's influence screen (#38).

    One round of the harness: client 0 sends its update reversed ×4. The
    scale it picks passes the server's own round (it is not rejected) and
    5 % more is rejected: it pushes as hard as the screen allows. (At a
    tolerance of 5 %: in round 1 of the harness, at 0.5 %, even a client
    that sends nothing dilutes the others' progress by more.)
    """
    from functools import partial

    import numpy as np

    suite = _suite()
    data, train = suite.harness_problem(0)
    cfg = suite.strategy_config(
        "fedavg", "synthetic-linreg", {"seed": 0, **suite.DEFENCE_CONFIG["influence"]}
    )
    options = {**suite.apply_options(cfg), **suite.DEFENCES["influence"]}
    held = [(m[: suite.VALIDATION_ROWS], y[: suite.VALIDATION_ROWS]) for m, y in data]
    options["validation_loss"] = partial(suite.harness_loss, held)
    options["influence_tolerance"] = 0.05
    rule, _ = suite.build_rule(cfg)
    x = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    trained = [train(i, x, 1, False, None) for i in range(suite.NUM_CLIENTS)]
    sent = {i: ({"x": xi["x"] - x["x"]}, {}) for i, (xi, _, _) in enumerate(trained)}
    sent[0] = ({"x": -4 * sent[0][0]["x"]}, {})
    server = suite.ServerRound(
        rule, options, x, [n for _, n, _ in trained], suite.AggregatorState()
    )

    def scaled(c):
        return {**sent, 0: ({"x": c * sent[0][0]["x"]}, {})}

    assert 0 in server.rehearse(sent)  # unscaled, the screen rejects it
    c = suite.influence_scale(server, sent, [0])
    assert 0 < c < 1
    assert 0 not in server.rehearse(scaled(c))
    assert 0 in server.rehearse(scaled(1.05 * c))


def test_a_run_owns_its_output_and_ends_it_with_how_it_stopped(tmp_path, monkeypatch):
    """Two runs given one --out must not overwrite each other; a run stopped
    (Ctrl-C, SIGTERM) before it wrote anything leaves an earlier run's figures
    as they were, and one stopped after says ``stopped``, not ``running``."""
    import json
    import os

    from benchmarks._output import OutputBusyError, owned, write_json

    suite = _suite()
    out = tmp_path / "attacks.json"
    with owned(out):
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}"):
            with owned(out):
                pass
    with owned(out):  # let go when the first run ended
        pass
    assert list(tmp_path.iterdir()) == []  # and no lock file left behind

    earlier = {"status": "completed", "cells": [1]}
    write_json(out, earlier)

    def stopped_at_once(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run_grid", stopped_at_once)
    with pytest.raises(KeyboardInterrupt):
        suite.run_grid_to(out, argparse.Namespace())
    assert json.loads(out.read_text()) == earlier

    def stopped_after_a_strategy(args):
        write_json(out, {"status": "running", "cells": [2]})
        raise SystemExit(143)  # the suite's SIGTERM handler

    monkeypatch.setattr(suite, "run_grid", stopped_after_a_strategy)
    with pytest.raises(SystemExit):
        suite.run_grid_to(out, argparse.Namespace())
    assert json.loads(out.read_text()) == {
        "status": "stopped",
        "cells": [2],
        "error": "SystemExit: 143",
    }


def test_the_absent_control_is_fedavg_over_the_clients_that_reply():
    """The ``absent`` control leaves the chosen clients out of every round.
    Oracle: FedAvg over the other nine, written out step by step (weights by
    examples, every defence off)."""
    import numpy as np

    suite = _suite()
    cfg = suite.strategy_config("fedavg", "synthetic-linreg", {"seed": 0})
    options = {**suite.apply_options(cfg), **suite.DEFENCES["off"]}
    _, train = suite.harness_problem(0)
    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    model, _ = suite.federate(cfg, options, x0, train, 3, "absent", [0, 1], 0)

    x = x0
    for server_round in (1, 2, 3):
        trained = [train(i, x, server_round, False, None) for i in range(2, 10)]
        total = sum(n for _, n, _ in trained)
        x = {"x": sum(xi["x"].astype(np.float64) * n / total for xi, n, _ in trained)}
    np.testing.assert_allclose(model["x"], x["x"], rtol=1e-5, atol=1e-6)
    honest, _ = suite.federate(cfg, options, x0, train, 3, None, (), 0)
    assert not np.allclose(honest["x"], model["x"])  # the two clients mattered


def test_the_suite_honours_num_hostile_as_the_strategies_do():
    """``num-hostile`` (and the other aggregator keys) reach the suite's
    server as they reach RuleHost's. Two colluders that sign-flip, FedAvg on
    multi-Krum: with f = 2 both are dropped and the model is FedAvg over the
    other eight, written out step by step; with the default f = 1 one of
    them is averaged in. Before, the suite ran f = 1 whatever was set."""
    import numpy as np

    suite = _suite()
    _, train = suite.harness_problem(0)
    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    models = {}
    for f in (1, 2):
        cfg = suite.strategy_config(
            "fedavg", "synthetic-linreg",
            {"seed": 0, "num-hostile": f, "krum-keep": 3, "clip-iterations": 2},
        )  # fmt: skip
        robust = suite.apply_options(cfg)["robust_options"]
        assert (robust.num_hostile, robust.krum_keep, robust.clip_iterations) == (
            f,
            3,
            2,
        )
        cfg = suite.strategy_config(
            "fedavg", "synthetic-linreg", {"seed": 0, "num-hostile": f}
        )
        options = {**suite.apply_options(cfg), **suite.DEFENCES["off"],
                   "aggregation": "multi_krum"}  # fmt: skip
        models[f], _ = suite.federate(
            cfg, options, x0, train, 3, "sign-flip", [0, 1], 0
        )

    x = x0
    for server_round in (1, 2, 3):
        trained = [train(i, x, server_round, False, None) for i in range(2, 10)]
        total = sum(n for _, n, _ in trained)
        x = {"x": sum(xi["x"].astype(np.float64) * n / total for xi, n, _ in trained)}
    np.testing.assert_allclose(models[2]["x"], x["x"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(models[1]["x"], x["x"], rtol=1e-3)


def test_a_cell_says_what_the_aggregator_did_to_hostile_and_honest_replies():
    """The suite averages the clients.jsonl signals of the aggregator in
    force over a run, hostile and honest apart: FedAvgM's trimmed mean cuts
    a sign-flipping client at more of its coordinates than any honest one
    does (``trimmed_share``); FedAdam's multi-Krum selects it less often
    (``selected``); FedExP's centered clipping shrinks it more
    (``center_clip_scale``). The mean records none of them."""
    import numpy as np

    suite = _suite()
    _, train = suite.harness_problem(0)
    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    signal = {"fedavgm": "trimmed_share", "fedadam": "selected",
              "fedexp": "center_clip_scale"}  # fmt: skip
    for name, key in signal.items():
        cfg = suite.strategy_config(name, "synthetic-linreg", {"seed": 0})
        options = suite.apply_options(cfg)
        _, counts = suite.federate(cfg, options, x0, train, 4, "sign-flip", [0], 0)
        hostile, honest = counts[f"{key}-hostile"], counts[f"{key}-honest"]
        if key == "trimmed_share":
            assert hostile > honest, (name, counts)
        else:
            assert hostile < honest, (name, counts)
    cfg = suite.strategy_config("fedavg", "synthetic-linreg", {"seed": 0})
    _, counts = suite.federate(
        cfg, suite.apply_options(cfg), x0, train, 2, "sign-flip", [0], 0
    )
    assert not any(k.endswith(("-hostile", "-honest")) for k in counts
                   if k != "rejected-hostile")  # fmt: skip


def test_the_report_of_a_partial_grid_marks_the_cells_it_lacks() -> None:
    # two grids merged (benchmarks/results keeps such files): FedExP ran an
    # attack that FedAvg did not
    suite = _suite()
    cell = {"seed": 0, "defence": "default", "hostile": 0, "attack": "none",
            "metric": 0.9, "distance": 0.0}  # fmt: skip
    attacked = {**cell, "hostile": 1, "metric": 0.8, "distance": 0.5}
    doc = {"task": "digits-mlp", "clients": 10, "metric": "accuracy", "cells": [
        {**cell, "strategy": "fedavg"},
        {**attacked, "strategy": "fedavg", "attack": "ipm"},
        {**cell, "strategy": "fedexp"},
        {**attacked, "strategy": "fedexp", "attack": "ipm", "distance": 1.0},
        {**attacked, "strategy": "fedexp", "attack": "alie"},
    ]}  # fmt: skip
    table = suite.markdown(doc, suite.summarise(doc))
    assert "| fedavg | 90.0 | +10.0 / 1.00× | — |" in table
    assert "| fedexp | 90.0 | +10.0 / 2.00× | +10.0 / nan× |" in table


def test_three_colluders_that_know_the_ceiling_no_longer_drive_feddua_away():
    """Three sign-flipping colluders of ten, each at the largest norm the
    defence leaves untouched (the ceiling included), against FedDuAdam in
    the least-squares harness. Without the norm ceiling the model runs away
    (every round's updates are larger than the last, and the round-relative
    bounds grow with them); with it, it stays within a few times FedAvg's
    distance. Oracle: FedAvg under the same colluders and defence."""
    suite = _suite()
    args = argparse.Namespace(
        level="harness", task=None, rounds=20, seeds=1,
        strategies=["fedavg", "feddua"], defences=["default", "no-ceiling"],
        attacks=["sign-flip"], hostile=[3],
    )  # fmt: skip
    cells = {
        (c["defence"], c["strategy"]): c
        for c in suite.run_grid(args)["cells"]
        if c["attack"] == "sign-flip"
    }

    def ratio(defence: str) -> float:
        own = cells[(defence, "feddua")]["distance"]
        return own / cells[(defence, "fedavg")]["distance"]

    assert ratio("no-ceiling") > 30  # measured 115x (seed 0 of 2: 40-115x)
    assert ratio("default") < 10  # measured 5.7x (the colluders stay under it)


def test_the_suites_secagg_calibration_round_steps_nothing_as_the_strategy():
    """The legacy strategy's calibration round (SecAgg+, no bound yet) moves
    neither the model nor the rule's state (test_secagg.py checks
    ``rule.num_updates == 0``). The suite stepped the rule there and dropped
    only the model, so FedExPM's momentum carried round 1's sums (and, with
    ``anchor-inflate``, a hostile client's inflated update) where the
    strategy's does not. Oracle: the rule is stepped once in two rounds."""
    import numpy as np

    suite = _suite()
    cfg = suite.strategy_config(
        "fedexpm", "synthetic-linreg", {"seed": 0, **suite.DEFENCE_CONFIG["secagg+"]}
    )
    options = {**suite.apply_options(cfg), **suite.DEFENCES["secagg+"]}
    _, train = suite.harness_problem(0)
    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    steps = []
    real = suite.apply_statistics

    def counted(rule, x, stats):
        steps.append(1)
        return real(rule, x, stats)

    suite.apply_statistics = counted
    try:
        for rounds, expected in ((1, 0), (2, 1)):
            steps.clear()
            suite.federate(cfg, options, x0, train, rounds, None, (), 0)
            assert len(steps) == expected
    finally:
        suite.apply_statistics = real


def test_the_suite_runs_fed_lambs_moment_exchange_and_its_attack():
    """Fed-LAMB's clients get v̂ and send v each round (the strategy's
    SecondMoments, as the app runs it); ``moment-inflate`` sends the largest
    v the moment cap leaves unscaled. Oracles: the library's own
    ``aggregate_second_moments`` and ``clip_moments``, with a trainer whose
    v is known."""
    import numpy as np

    from fedadapt.strategies.fedlamb import aggregate_second_moments, clip_moments

    suite = _suite()
    cfg = suite.strategy_config("fed-lamb", "synthetic-linreg", {"seed": 0})
    options = {**suite.apply_options(cfg), **suite.DEFENCES["default"]}
    _, plain = suite.harness_problem(0)
    received = []

    def train(i, x, server_round, poisoned, exchange):
        received.append((server_round, exchange))
        state, n, _ = plain(i, x, server_round, poisoned, None)
        v = {"x": np.full(suite.DIM, 1e-3 * (i + 1), np.float32)}
        return state, n, v

    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    honest_v = [{"x": np.full(suite.DIM, 1e-3 * (i + 1), np.float32)}
                for i in range(suite.NUM_CLIENTS)]  # fmt: skip
    # honest: round 1 sends no v̂, round 2 the mean of round 1's v
    suite.federate(cfg, options, x0, train, 2, None, (), 0)
    first = {len(e[1]) for r, e in received if r == 1}
    assert first == {0}  # the name of the exchange, no arrays yet
    (sent,) = {tuple(e[1]["x"].tolist()) for r, e in received if r == 2}
    want = aggregate_second_moments(None, honest_v, eps=1e-8)
    np.testing.assert_allclose(sent, want["x"], rtol=1e-6)
    assert all(e[0]["local-update"] == "fed-lamb" for _, e in received)
    # the attack: just under the cap, so the cap leaves it as it is
    inflated = suite.inflated_moments(honest_v[1:], 4.0, 1)
    clipped = clip_moments([*honest_v[1:], inflated], 4.0)[-1]
    np.testing.assert_array_equal(clipped["x"], inflated["x"])
    louder = {"x": inflated["x"] * 1.05}
    assert np.all(clip_moments([*honest_v[1:], louder], 4.0)[-1]["x"] < louder["x"])
    received.clear()
    suite.federate(cfg, options, x0, train, 2, "moment-inflate", [0], 0)
    (sent,) = {tuple(e[1]["x"].tolist()) for r, e in received if r == 2}
    want = aggregate_second_moments(None, [inflated, *honest_v[1:]], eps=1e-8)
    np.testing.assert_allclose(sent, want["x"], rtol=1e-6)


def test_the_suite_runs_fed_lambs_moment_exchange_under_secagg():
    """Under SecAgg+ each client's v travels in its masked vector, in the
    scales the server sends (stop 65): ln v in round 1, then v/v̂ coordinate
    by coordinate, held to [0, 2]; v̂ takes the revealed mean (the geometric
    one in round 1, the calibration round's included), as the legacy
    strategy does. ``moment-inflate`` sends more than any range holds, so
    Flower's mod clips each of its coordinates to the top: the log scale's
    in round 1, 2·v̂ after. Oracles: the closed forms of those means, and
    ``aggregate_second_moments`` for the max."""
    import math

    import numpy as np

    from fedadapt.strategies.fedlamb import MOMENT_HEADROOM, MOMENT_LOG_TOP

    suite = _suite()
    overrides = {"seed": 0, **suite.DEFENCE_CONFIG["secagg+"]}
    cfg = suite.strategy_config("fed-lamb", "synthetic-linreg", overrides)
    options = {**suite.apply_options(cfg), **suite.DEFENCES["secagg+"]}
    _, plain = suite.harness_problem(0)
    received = []
    n = suite.NUM_CLIENTS
    honest_v = [1e-3 * (i + 1) for i in range(n)]

    def train(i, x, server_round, poisoned, exchange):
        received.append((server_round, exchange))
        state, num, _ = plain(i, x, server_round, poisoned, None)
        return state, num, {"x": np.full(suite.DIM, honest_v[i], np.float32)}

    def sent_in(r):
        (sent,) = {tuple(e[1]["x"].tolist()) for rnd, e in received if rnd == r}
        return np.array(sent)

    def held_mean(v, v_hat):  # round ≥ 2: each v held to 2·v̂, then the mean
        return sum(min(x, MOMENT_HEADROOM * v_hat) for x in v) / n

    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    _, counts = suite.federate(cfg, options, x0, train, 3, None, (), 0)
    assert counts["refused-rounds"] == 0
    geometric = math.exp(sum(math.log(v) for v in honest_v) / n)
    np.testing.assert_allclose(sent_in(2), geometric, rtol=1e-4)
    # round 2: client 9's v (2.2·v̂) is held to 2·v̂; the mean exceeds v̂
    second = held_mean(honest_v, geometric)
    assert honest_v[-1] > MOMENT_HEADROOM * geometric and second > geometric
    np.testing.assert_allclose(sent_in(3), second, rtol=1e-4)
    received.clear()
    suite.federate(cfg, options, x0, train, 3, "moment-inflate", [0], 0)
    floor = 1e-12  # secagg.LOG_SCALE_FLOOR
    logs = [math.log(MOMENT_LOG_TOP / floor)] + [
        math.log(v / floor) for v in honest_v[1:]
    ]
    inflated = floor * math.exp(sum(logs) / n)
    np.testing.assert_allclose(sent_in(2), inflated, rtol=1e-4)
    assert inflated < 40 * geometric  # a factor of at most e^(ln(1e15)/10)
    then = held_mean([MOMENT_HEADROOM * inflated] + honest_v[1:], inflated)
    np.testing.assert_allclose(sent_in(3), max(then, inflated), rtol=1e-4)


def test_a_false_local_clip_claim_changes_nothing():
    """``false-local-clip`` sends an honest update and v but claims, every
    round, that it held its v to the server's ranges. Until stop 65 the
    server widened the ranges 4× after any such claim (to 4^4 in four
    rounds); the ranges are per coordinate and fixed since, so the run is
    the honest run to the bit. Oracle: the honest run."""
    import numpy as np

    suite = _suite()
    overrides = {"seed": 0, **suite.DEFENCE_CONFIG["secagg+"]}
    cfg = suite.strategy_config("fed-lamb", "synthetic-linreg", overrides)
    options = {**suite.apply_options(cfg), **suite.DEFENCES["secagg+"]}
    _, plain = suite.harness_problem(0)
    seen = {}

    def train(i, x, server_round, poisoned, exchange):
        seen.setdefault(server_round, exchange[1])
        state, n, _ = plain(i, x, server_round, poisoned, None)
        return state, n, {"x": np.full(suite.DIM, 1e-3 * (i + 1), np.float32)}

    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    honest, counts = suite.federate(cfg, options, x0, train, 6, None, (), 0)
    honest_v_hat, seen = seen, {}
    claimed, counts = suite.federate(
        cfg, options, x0, train, 6, "false-local-clip", [0], 0
    )
    assert counts["refused-rounds"] == 0
    np.testing.assert_array_equal(claimed["x"], honest["x"])
    for r in range(2, 7):
        np.testing.assert_array_equal(seen[r]["x"], honest_v_hat[r]["x"])


def test_a_false_clip_report_under_secagg_costs_one_round_then_the_client_is_out():
    """``false-clip`` reports a clip count with an honest update: the masked
    sum is refused (it cannot be taken apart), and the client, named by its
    own clear metric, is not sampled again, as the legacy strategy's
    quarantine does. Before, every round was refused. Oracle: the run with
    that client absent, one round shorter (round 1 is the calibration
    round: refused, it stays one, so the attacked run calibrates in round 2
    without the client, as the absent run does in round 1)."""
    import numpy as np

    suite = _suite()
    overrides = {"seed": 0, **suite.DEFENCE_CONFIG["secagg+-unrotated"]}
    cfg = suite.strategy_config("fedexp", "synthetic-linreg", overrides)
    options = {**suite.apply_options(cfg), **suite.DEFENCES["secagg+-unrotated"]}
    _, train = suite.harness_problem(0)
    x0 = {"x": np.zeros(suite.DIM, dtype=np.float32)}
    attacked, counts = suite.federate(cfg, options, x0, train, 4, "false-clip", [0], 0)
    assert counts["refused-rounds"] == 1
    absent, counts = suite.federate(cfg, options, x0, train, 3, "absent", [0], 0)
    assert counts["refused-rounds"] == 0
    np.testing.assert_array_equal(attacked["x"], absent["x"])
    assert not np.array_equal(attacked["x"], x0["x"])
    # with f = 0 nobody is left out: every round refused, the model unmoved
    cfg = suite.strategy_config(
        "fedexp", "synthetic-linreg", {**overrides, "num-hostile": 0}
    )
    stalled, counts = suite.federate(cfg, options, x0, train, 4, "false-clip", [0], 0)
    assert counts["refused-rounds"] == 4
    np.testing.assert_array_equal(stalled["x"], x0["x"])
