"""Legacy-API ServerApp (``ServerApp(server_fn=...)``) for ``NumPyClient``s.

Runs the same run config with :mod:`fedadapt.strategies.legacy` and
:class:`fedadapt.client.numpy_client.FedAdaptClient`; to use it, point the
app components at ``fedadapt.server.legacy_app:app`` and
``fedadapt.client.numpy_client:app``. Writes the same results.json and
curves.png (metrics of the model the strategy returns: with
``average-last-two`` the average of the last two iterates, which is also
the legacy server's final parameters, written to final_model.npz when the
run completes). With run-config ``secure-aggregation = "secagg+"`` the
rounds run under Flower's SecAgg+ (:func:`run_secure`,
:mod:`fedadapt.strategies.secagg`). Checkpoints and resume are Message-API
only: this app writes none (results.json records ``checkpoint-every`` = 0) and refuses a
``checkpoint-every`` or ``resume-from`` other than the default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flwr.compat.common.recorddict_compat as compat
from flwr.common import (
    Context,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server import (
    History,
    Server,
    ServerApp,
    ServerAppComponents,
    ServerConfig,
    SimpleClientManager,
)
from flwr.server.client_manager import ClientManager
from flwr.server.compat import LegacyContext, start_grid
from flwr.server.strategy import Strategy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from fedadapt.config import KEYS, ConfigError, validate_run_config
from fedadapt.server.results import RunRecorder
from fedadapt.server.run import (
    RoundHook,
    central_evaluator,
    check_names,
    claim_output_folder,
    ended_by,
    initial_state,
    log_user_errors_in_one_line,
    open_recorder,
    record_end,
    record_local_update,
    save_final_model,
    server_validation_loss,
)
from fedadapt.server.strategy_factory import build_strategy
from fedadapt.strategies import wire
from fedadapt.strategies.adapter import FederationFailedError
from fedadapt.tasks import TASKS

# recorder and strategy of each run this process serves, for the lifespan's
# failure mark
_RUNS: dict[int, tuple[RunRecorder, Any]] = {}


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
    """Build the legacy strategy and server config from the run config.

    As the Message-API ServerApp, it checks the config and the test data
    before results.json is started; such errors are logged as one line.
    """
    log_user_errors_in_one_line()
    cfg = validate_run_config(context.run_config)
    check_names(cfg)
    for key in ("checkpoint-every", "resume-from"):
        if cfg[key] != KEYS[key].default:
            raise ConfigError(key, "checkpoints need the Message-API ServerApp")
    cfg = {**cfg, "checkpoint-every": 0}  # the default: none written here
    task = TASKS.get(cfg["task"])
    # loads the test set (data checked now); None: central evaluation off
    evaluate = central_evaluator(task, cfg)
    state = initial_state(task, cfg)
    keys = list(state)

    def evaluate_fn(
        server_round: int, arrays: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, dict[str, Scalar]] | None:
        scores = hook(server_round, dict(zip(keys, arrays[: len(keys)], strict=True)))
        return None if scores is None else (scores["loss"], dict(scores))

    def fit_config(server_round: int) -> dict[str, Any]:
        return {wire.LR: cfg["client-lr"], wire.SERVER_ROUND: server_round}

    strategy = build_strategy(
        cfg,
        api="legacy",
        sampling_seed=cfg["seed"] if cfg["seeded-sampling"] else None,
        query_timeout=cfg["round-timeout"],  # the partition-id query, in all
        initial_parameters=ndarrays_to_parameters(list(state.values())),
        array_names=keys,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=fit_config,
        fit_metrics_aggregation_fn=weighted_mean,
        evaluate_metrics_aggregation_fn=weighted_mean,
        validation_loss=server_validation_loss(task, cfg),
    )
    folder = claim_output_folder(cfg, context.run_id)  # a live run's folder: fail now
    recorder = open_recorder(folder, cfg, context.run_id)
    federated = recorder.data["evaluation"]["federated"]
    if federated["source"] != "off":  # Flower's legacy loop evaluates after the hook
        federated["recorded"] = "no: the legacy API's rounds record central only"
    recorder.record_federated_exchange("separate")  # no folding in this API
    record_local_update(recorder, strategy)
    hook = RoundHook(cfg, task, strategy, recorder, evaluate=evaluate)
    _RUNS[context.run_id] = (recorder, strategy)
    config = ServerConfig(
        num_rounds=cfg["num-server-rounds"], round_timeout=cfg["round-timeout"]
    )
    server = RecordingServer(
        client_manager=SimpleClientManager(),
        strategy=strategy,
        recorder=recorder,
        array_names=keys,
    )
    return ServerAppComponents(server=server, config=config)


class RecordingServer(Server):
    """Flower's legacy ``Server`` that marks the run completed when its loop ends.

    Flower's legacy round is fit, central evaluation (where :class:`RoundHook`
    records the round), then federated evaluation; results.json is finished
    only after the last round's federated evaluation returned, so a loop that
    raises there is not reported as completed, and what that evaluation adds
    to the round's report (its seeded sample) is in the final file. The
    server's final parameters (the model evaluated last) are written to
    final_model.npz under ``array_names`` (the state_dict keys) first.
    """

    def __init__(
        self,
        *,
        client_manager: ClientManager,
        strategy: Strategy,
        recorder: RunRecorder,
        array_names: Sequence[str],
    ) -> None:
        super().__init__(client_manager=client_manager, strategy=strategy)
        self.recorder = recorder
        self.array_names = list(array_names)

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        """Run Flower's loop, write final_model.npz, mark results.json completed.

        A run in which no round used a train reply is marked failed instead.
        """
        result = super().fit(num_rounds, timeout)
        self.finish_run(self.parameters)
        return result

    def finish_run(self, parameters: Parameters) -> None:
        """Write final_model.npz (``parameters``), mark results.json completed.

        A run in which no round used a train reply is marked failed instead
        (and raises :class:`FederationFailedError`).
        """
        failure = self.strategy.unusable_run_failure()  # type: ignore[attr-defined]
        if failure is not None:  # not one reply used: nothing was trained
            self.recorder.finish("failed", error=failure)
            raise FederationFailedError(failure)
        arrays = parameters_to_ndarrays(parameters)[: len(self.array_names)]
        save_final_model(
            self.recorder.run_dir, dict(zip(self.array_names, arrays, strict=True))
        )
        record_end(self.recorder, self.strategy)
        self.recorder.finish("completed")


class RecordedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow; a round it halts is a failed round of the run.

    Flower's workflow stops a round silently (an ERROR line, no aggregate,
    the model kept) when fewer clients answer a stage than its reconstruction
    threshold: clients that drop out mid-protocol. Above the threshold the
    round completes with the others (the dropped ones' masks are removed
    from their shares). Here a halted round reaches the strategy's records
    (results.json ``replies.problem``, counted toward ``max-failed-rounds``)
    instead of leaving no trace.
    """

    def __call__(self, grid: Grid, context: Context) -> None:
        """Run Flower's four stages; record the round if they halted."""
        config = context.state.config_records[MAIN_CONFIGS_RECORD]
        server_round = int(config[WorkflowKey.CURRENT_ROUND])  # type: ignore[arg-type]
        super().__call__(grid, context)
        strategy = context.strategy  # type: ignore[attr-defined]
        if "train_replies" not in strategy.round_reports.get(server_round, {}):
            strategy.secagg_halted(
                server_round,
                "SecAgg+ halted: fewer clients answered a stage than its "
                "reconstruction threshold (clients dropped out; "
                "secagg-reconstruction-threshold, secagg-num-shares); the "
                "model is kept",
            )


def run_secure(
    grid: Grid, context: Context, server: RecordingServer, config: ServerConfig
) -> None:
    """Run the rounds with Flower's SecAgg+ workflow, then finish as Server.fit.

    Flower's ``DefaultWorkflow`` (fit, central evaluation, federated
    evaluation per round, as the legacy ``Server``) with
    ``SecAggPlusWorkflow`` as its fit step: four exchanges per round, after
    which the strategy's ``aggregate_fit`` gets only the masked sum
    (:mod:`fedadapt.strategies.secagg`). The strategy's settings fix the
    quantisation and the key sharing.
    """
    settings = server.strategy.secagg  # type: ignore[attr-defined]
    legacy = LegacyContext(
        context,
        config=config,
        strategy=server.strategy,
        client_manager=server.client_manager(),
    )
    workflow = DefaultWorkflow(
        fit_workflow=RecordedSecAggPlusWorkflow(
            num_shares=settings.num_shares,
            reconstruction_threshold=settings.reconstruction_threshold,
            max_weight=settings.max_weight,
            clipping_range=settings.clipping_range,
            quantization_range=settings.quantization_range,
            modulus_range=settings.modulus_range,
            timeout=config.round_timeout,
        )
    )
    workflow(grid, legacy)
    server.finish_run(
        compat.arrayrecord_to_parameters(
            legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True
        )
    )


def run(
    grid: Grid,
    context: Context,
    components_fn: Callable[[Context], ServerAppComponents] | None = None,
) -> None:
    """Run one legacy-API run on ``grid``; results.json never stays ``running``.

    The components (:func:`server_fn` by default) run as Flower's
    compatibility mode does (``start_grid``), or, when the strategy runs
    under SecAgg+, through :func:`run_secure`. Also what the Message-API
    ServerApp runs for ``secure-aggregation = "secagg+"`` (Flower has SecAgg+
    for its legacy API only), so that one ServerApp serves every mode.

    Flower's legacy loop gives no hook on failure, so after the run a
    results.json still ``running`` (:class:`RecordingServer` never marked it
    ``completed``) means the loop raised or was stopped: the run is marked
    as the Message-API ServerApp marks it (``stopped`` for a signal,
    :func:`~fedadapt.server.run.ended_by`; otherwise ``failed`` with
    the strategy's ``failure`` after ``max-failed-rounds``, or the error).
    """
    error: BaseException | None = None
    try:
        components = (components_fn or server_fn)(context)
        server, config = components.server, components.config
        assert isinstance(server, RecordingServer) and config is not None
        if getattr(server.strategy, "secagg", None) is None:
            start_grid(grid=grid, server=server, config=config)
        else:
            run_secure(grid, context, server, config)
    except BaseException as raised:
        error = raised
        raise
    finally:
        recorder, strategy = _RUNS.pop(context.run_id, (None, None))
        if recorder is not None and recorder.data["status"] == "running":
            status, why = (
                ended_by(error)
                if error is not None
                else ("failed", "the ServerApp stopped before the last round")
            )
            recorder.finish(status, error=getattr(strategy, "failure", None) or why)


def make_app(server_fn: Callable[[Context], ServerAppComponents]) -> ServerApp:
    """Wrap ``server_fn`` in a ServerApp whose main is :func:`run`."""
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        run(grid, context, server_fn)

    return app


app = make_app(server_fn)
