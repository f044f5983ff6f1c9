"""Legacy-API ServerApp (``ServerApp(server_fn=...)``) for ``NumPyClient``s.

Runs the same run config with :mod:`fedadapt.strategies.legacy` and
:class:`fedadapt.client.numpy_client.FedAdaptClient`; to use it, point the
app components at ``fedadapt.server.legacy_app:app`` and
``fedadapt.client.numpy_client:app``. Writes the same results.json and
curves.png. Checkpoints and resume are Message-API only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from flwr.common import Context, NDArrays, Scalar, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from fedadapt.config import ConfigError, validate_run_config
from fedadapt.server.results import RunRecorder, run_directory
from fedadapt.server.run import RoundHook, check_names, initial_state
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.tasks import TASKS

# the recorder of each run this process serves, for the lifespan's failure mark
_RECORDERS: dict[int, RunRecorder] = {}


def weighted_mean(results: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
    """Average numeric metrics weighted by num-examples (as the Message API)."""
    total = sum(n for n, _ in results)
    keys = set.intersection(*(set(m) for _, m in results)) if results else set()
    return {
        k: sum(n * float(m[k]) for n, m in results) / total
        for k in sorted(keys)
        if all(isinstance(m[k], int | float) for _, m in results)
    }


def server_fn(context: Context) -> ServerAppComponents:
    """Build the legacy strategy and server config from the run config."""
    cfg = validate_run_config(context.run_config)
    check_names(cfg)
    for key in ("checkpoint-every", "resume-from"):
        if cfg[key]:
            raise ConfigError(key, "checkpoints need the Message-API ServerApp")
    task = TASKS.get(cfg["task"])
    state = initial_state(task, cfg)
    keys = list(state)
    recorder = RunRecorder(run_directory(cfg, context.run_id), cfg, context.run_id)
    _RECORDERS[context.run_id] = recorder

    def evaluate_fn(
        server_round: int, arrays: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, dict[str, Scalar]] | None:
        scores = hook(server_round, dict(zip(keys, arrays[: len(keys)], strict=True)))
        if server_round == cfg["num-server-rounds"]:
            recorder.finish("completed")
        return None if scores is None else (scores["loss"], dict(scores))

    def fit_config(server_round: int) -> dict[str, Any]:
        return {"lr": cfg["client-lr"], "server-round": server_round}

    strategy = build_strategy(
        cfg,
        api="legacy",
        initial_parameters=ndarrays_to_parameters(list(state.values())),
        array_names=keys,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=fit_config,
        fit_metrics_aggregation_fn=weighted_mean,
        evaluate_metrics_aggregation_fn=weighted_mean,
    )
    hook = RoundHook(cfg, task, strategy, recorder)
    config = ServerConfig(
        num_rounds=cfg["num-server-rounds"], round_timeout=cfg["round-timeout"]
    )
    return ServerAppComponents(strategy=strategy, config=config)


def make_app(server_fn: Callable[[Context], ServerAppComponents]) -> ServerApp:
    """Wrap ``server_fn`` in a ServerApp that marks runs that end early as failed.

    Flower's legacy loop gives no hook on failure, so a lifespan checks after
    the run: an exception (e.g. the strategy's ``FederationFailedError``
    after ``max-failed-rounds``) is recorded as the error; results.json still
    ``running`` (the last round's evaluate_fn never marked it ``completed``)
    means the loop was stopped. Either way the run is marked ``failed`` as the
    Message-API ServerApp does.
    """
    app = ServerApp(server_fn=server_fn)

    def _mark_failed(run_id: int, error: str) -> None:
        recorder = _RECORDERS.pop(run_id, None)
        if recorder is not None and recorder.data["status"] == "running":
            recorder.finish("failed", error=error)

    @app.lifespan()
    def _mark_unfinished(context: Context) -> Iterator[None]:
        try:
            yield
        except BaseException as error:
            _mark_failed(context.run_id, repr(error))
            raise
        _mark_failed(context.run_id, "the ServerApp stopped before the last round")

    return app


app = make_app(server_fn)
