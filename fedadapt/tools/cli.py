"""``fedadapt`` command line.

``fedadapt deploy`` does the same on a real deployment started here (a
SuperLink and N SuperNodes as processes, optionally TLS + SuperNode
authentication; ``fedadapt.tools.deploy.local``); ``fedadapt certs`` and
``fedadapt node-keys`` make the certificates and keys for one elsewhere;
``fedadapt make-node-data`` writes one on-disk dataset per node (node-config
``data-path``) from a task's data, for demos and tests. ``fedadapt clients
RUN_DIR`` summarises per node what the defences did to its replies over a
run (``fedadapt.server.client_records.summarize_nodes``).

``fedadapt simulate`` runs the app in Flower's Ray simulation on this machine
with a private, loopback-only SuperLink that it starts and always stops
(also on Ctrl-C and on failure). It waits for the run's real outcome (``flwr
run`` exits 0 even when a run fails), prints where the results went, and
exits non-zero unless every round completed with usable replies.

Both end every process they started (normal end, ``--timeout``, Ctrl-C,
SIGTERM, SIGHUP, an error of their own), verify that none is left, and mark
a run that did not complete ``stopped`` or ``failed`` with the reason in its
results.json (docs/failures.md).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from flwr.common.config import parse_config_args

from fedadapt.tools.submission import (
    RunOutcome,
    SimulationSuperLink,
    Submitted,
    Terminated,
    raise_on_termination,
    settle_run,
    submit_run,
)


def _run_config(text: str | None) -> dict[str, Any]:
    """``--run-config``'s keys, as flwr run parses them; ValueError if unreadable.

    Flower raises click's exception, which would end the command with a
    traceback; this names the option and keeps Flower's format hint.
    """
    import click

    try:
        return parse_config_args([text] if text else None)
    except click.ClickException as error:
        raise ValueError(f"--run-config {text!r}: {error.message}") from None


def _prepare(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """App path and validated run-config overrides (fail before starting)."""
    from fedadapt.config import validate_run_config

    app = Path(args.app).resolve()
    overrides = _run_config(args.run_config)
    if getattr(args, "resume", None):
        overrides = resume_overrides(Path(args.resume), overrides)
    overrides.setdefault("output-dir", str(Path("outputs").resolve()))
    validate_run_config(overrides)
    return app, overrides


def resume_overrides(run_dir: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """Run config that continues the run in ``run_dir`` (``simulate --resume``).

    The run config recorded in ``<run_dir>/results.json``, with
    ``resume-from`` set to the folder's checkpoint and ``output-dir`` /
    ``run-name`` set so that the run lands in ``run_dir`` again; ``overrides``
    (``--run-config``, e.g. a larger ``num-server-rounds``) apply on top.
    Raises ValueError naming the missing file and what to do.
    """
    import json

    from fedadapt.server.checkpoint import CHECKPOINT_FILE
    from fedadapt.server.results import RESULTS_FILE

    run_dir = run_dir.expanduser().resolve()
    results, checkpoint = run_dir / RESULTS_FILE, run_dir / CHECKPOINT_FILE
    try:
        saved = json.loads(results.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--resume {run_dir}: cannot read the run config from {results} "
            f"({error}); give the folder of a fedadapt run"
        ) from None
    if not checkpoint.is_file():
        raise ValueError(
            f"--resume {run_dir}: no {CHECKPOINT_FILE} in that folder (the run "
            "wrote none: checkpoint-every=0, or it stopped before the first); "
            "start the run again instead"
        )
    return {
        **saved,
        **overrides,
        "resume-from": str(checkpoint),
        "output-dir": str(run_dir.parent),
        "run-name": run_dir.name,
    }


def report(outcome: RunOutcome) -> int:
    """Print how a run ended; return the process exit code (0 = success)."""
    print(
        f"fedadapt: run {outcome.run_id} {outcome.status} in "
        f"{outcome.wall_time_s:.1f}s",
        flush=True,
    )
    if outcome.status != "finished:completed":
        print(f"fedadapt: {outcome.details}", file=sys.stderr)
        if outcome.error and outcome.error not in outcome.details:
            print(f"fedadapt: error: {outcome.error}", file=sys.stderr)
        if outcome.log is not None:
            print(f"fedadapt: Flower's log: {outcome.log}", file=sys.stderr)
        return 1
    if outcome.results is not None:
        print(f"fedadapt: results: {outcome.results}")
        print(f"fedadapt: curves:  {outcome.results.parent / 'curves.png'}")
    for problem in outcome.problems:
        print(f"fedadapt: problem: {problem}", file=sys.stderr)
    return 0 if outcome.ok else 1


def _settle(track: Submitted, status: str, reason: str) -> None:
    """Settle the run (see :func:`settle_run`) and say how results.json ends."""
    ended = settle_run(track, status, reason)
    if ended is not None:
        print(f"fedadapt: results.json status: {ended}", file=sys.stderr)


def _supervised(
    target: AbstractContextManager[Any],
    run: Callable[[Any, Submitted], RunOutcome],
    timeout: float,
) -> RunOutcome:
    """Run ``run(target, track)`` inside ``target``, which stops on exit.

    Then, with every process ended, a run that did not complete is settled
    in its results.json: a timeout or Ctrl-C/SIGTERM marks it ``stopped``,
    our own error or a run Flower failed marks it ``failed``, each with the
    reason (for a failed run the error in Flower's log, see
    :func:`submit_run`; a ServerApp that still holds the folder is left
    alone).
    """
    track = Submitted()
    try:
        with target as started:
            outcome: RunOutcome = run(started, track)
    except KeyboardInterrupt:
        _settle(track, "stopped", "interrupted (Ctrl-C / SIGINT to fedadapt)")
        raise
    except Terminated as stop:
        _settle(track, "stopped", f"fedadapt stopped the run: {stop.reason}")
        raise
    except BaseException as error:
        _settle(track, "failed", f"fedadapt ended with an error: {error!r}")
        raise
    if outcome.status == "timed-out":
        _settle(track, "stopped", f"timed out after {timeout:g}s (--timeout)")
    elif outcome.status != "finished:completed":
        reason = outcome.error or f"Flower: {outcome.status} {outcome.details}"
        _settle(track, "failed", reason)
    return outcome


def simulate(args: argparse.Namespace) -> int:
    """Run one simulation end to end; return the process exit code."""
    from fedadapt.tools.deploy.ray_cluster import suite_federation_config

    app, overrides = _prepare(args)
    flwr_home = Path(args.flwr_home or app / ".flwr").resolve()
    # one CPU a client unless told: one-thread actors side by side, as a suite
    federation_config = suite_federation_config(args.federation_config)

    def run(superlink: SimulationSuperLink, track: Submitted) -> RunOutcome:
        return submit_run(
            superlink,
            app,
            overrides,
            args.num_supernodes,
            args.timeout,
            stream=not args.quiet,
            federation_config=federation_config,
            track=track,
        )

    superlink = SimulationSuperLink(flwr_home, args.port, args.ray_address)
    return report(_supervised(superlink, run, args.timeout))


def deploy(args: argparse.Namespace) -> int:
    """Run the app on a SuperLink + SuperNodes started as processes here."""
    from fedadapt.tools.deploy.local import LocalDeployment

    app, overrides = _prepare(args)
    workdir = Path(args.workdir or app / ".flwr-deploy").resolve()

    def run(deployment: LocalDeployment, track: Submitted) -> RunOutcome:
        print(
            f"fedadapt: SuperLink on {deployment.address} "
            f"({'TLS' if args.tls else 'insecure'}"
            f"{', SuperNode auth' if args.auth else ''}), "
            f"{args.num_supernodes} SuperNodes online; logs in {workdir}",
            flush=True,
        )
        return submit_run(
            deployment,
            app,
            overrides,
            args.num_supernodes,
            args.timeout,
            stream=not args.quiet,
            track=track,
        )

    data_paths = [Path(p) for p in args.data_path] or None
    deployment = LocalDeployment(
        workdir,
        args.num_supernodes,
        tls=args.tls,
        auth=args.auth,
        port=args.port,
        data_paths=data_paths,
        supernode=args.supernode,
    )
    return report(_supervised(deployment, run, args.timeout))


def certs(args: argparse.Namespace) -> int:
    """Write a CA and a SuperLink certificate for the given hosts."""
    from fedadapt.tools.deploy.certs import make_certificates

    for path in make_certificates(
        Path(args.out), args.host, args.days, args.force
    ).values():
        print(path)
    return 0


def node_keys(args: argparse.Namespace) -> int:
    """Write SuperNode authentication key pairs."""
    from fedadapt.tools.deploy.certs import make_node_keys, public_key_path

    for path in make_node_keys(Path(args.out), args.count, args.force):
        print(f"{path}  (register {public_key_path(path)})")
    return 0


def make_node_data(args: argparse.Namespace) -> int:
    """Write one dataset per node from a task's data (demos, tests)."""
    from fedadapt.config import validate_run_config
    from fedadapt.tasks import TASKS
    from fedadapt.tasks.node_data import write_node_datasets
    from fedadapt.tools.deploy.local import data_path_node_config

    overrides = _run_config(args.run_config)
    overrides["task"] = args.task
    for key, value in (
        ("partition", args.partitioner),
        ("dirichlet-alpha", args.alpha),
        ("seed", args.seed),
    ):
        if value is not None:
            overrides[key] = value
    cfg = validate_run_config(overrides)
    formats = [f for part in args.format for f in part.split(",") if f]
    paths = write_node_datasets(
        TASKS.get(cfg["task"]),
        cfg,
        args.num_nodes,
        Path(args.out),
        formats,
        hf_images=not args.hf_arrays,
        force=args.force,
    )
    for path in paths:
        option = shlex.quote(data_path_node_config(path))
        print(f"{path}  (--node-config {option})")
    return 0


def clients(args: argparse.Namespace) -> int:
    """Print per node what the defences did to it over a run (clients.jsonl)."""
    import json

    from fedadapt.server.client_records import (
        SIGNALS,
        load_client_records,
        summarize_nodes,
    )

    summary = summarize_nodes(load_client_records(args.run_dir))
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    recorded = [name for name in SIGNALS if any(e[name] is not None for e in summary)]
    columns = ["node", "partition", "replies", "used", *recorded]
    print("\t".join(columns))
    for entry in summary:
        cells = [str(entry[c]) if c not in SIGNALS or entry[c] is None
                 else f"{entry[c]:.3f}" for c in columns]  # fmt: skip
        print("\t".join(cells))
    for name in recorded:  # per signal: the node furthest the suspicious way
        gapped = [e for e in summary if name in e["gaps"]]
        if not gapped:
            continue
        top = max(gapped, key=lambda e: e["gaps"][name])
        honest = SIGNALS[name][1]
        verdict = (
            "not measured on honest runs"
            if honest is None
            else f"{'beyond' if top['gaps'][name] > honest else 'within'} the "
            f"largest gap honest nodes reached in our runs ({honest:g})"
        )
        print(f"{name}: node {top['node']} (partition {top['partition']}) "
              f"{top[name]:.3f}, {top['gaps'][name]:+.3f} from the others' "
              f"median: {verdict}")  # fmt: skip
    if recorded:
        print("(the node the defences discount most: hostile, or an honest node "
              "whose data differs from the others'; docs/robustness.md)")  # fmt: skip
    return 0


def positive_int(text: str) -> int:
    """Parse ``--num-supernodes``: an integer of at least 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (>= 1)")
    return value


def _run_options(parser: argparse.ArgumentParser, nodes: int) -> None:
    parser.add_argument("--app", default=".", help="Flower app directory (default: .)")
    parser.add_argument(
        "--num-supernodes",
        type=positive_int,
        default=nodes,
        help=f"nodes of the federation, at least 1 (default: {nodes})",
    )
    parser.add_argument(
        "--run-config", default="", help='overrides, e.g. "num-server-rounds=5 seed=1"'
    )
    parser.add_argument("--port", type=int, help="SuperLink port (default: a free one)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="stop the run after this many seconds; it ends 'stopped' "
        "(default: %(default)g)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not stream run logs")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedadapt`` command."""
    parser = argparse.ArgumentParser(prog="fedadapt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="run the app in a local simulation")
    _run_options(sim, nodes=10)
    sim.add_argument("--flwr-home", help="FLWR_HOME to use (default: <app>/.flwr)")
    sim.add_argument(
        "--ray-address",
        help="run on this existing Ray cluster (e.g. 10.0.0.5:6379) instead of a "
        "private one (docs/ray-cluster.md)",
    )
    sim.add_argument(
        "--federation-config",
        default="",
        help='simulation settings, e.g. "client-resources-num-cpus=2 '
        'client-resources-num-gpus=0.25" (flwr run --federation-config; '
        "default: one CPU a client)",
    )
    sim.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its checkpoint.pkl with the run "
        "config of its results.json (--run-config adds to it, e.g. a larger "
        "num-server-rounds); the run goes on in the same folder",
    )
    dep = commands.add_parser(
        "deploy", help="run the app on a SuperLink + SuperNodes started as processes"
    )
    _run_options(dep, nodes=3)
    dep.add_argument("--tls", action="store_true", help="TLS with a generated CA")
    dep.add_argument("--auth", action="store_true", help="SuperNode authentication")
    dep.add_argument(
        "--workdir", help="logs, state, certificates (default: <app>/.flwr-deploy)"
    )
    dep.add_argument(
        "--supernode",
        choices=("fedadapt", "flower"),  # fedadapt.tools.deploy.local.SUPERNODES
        default="fedadapt",
        help="fedadapt (default): fedadapt-supernode, Flower's SuperNode with a "
        "short wait for the next message and ClientApp processes forked with "
        "Flower imported; flower: flower-supernode unchanged",
    )
    dep.add_argument(
        "--data-path",
        action="append",
        default=[],
        help="node i's own data (node-config data-path; repeat once per SuperNode, "
        "e.g. the paths `fedadapt make-node-data` prints); default: each node "
        "gets a partition of the task's data by partition-id",
    )
    crt = commands.add_parser("certs", help="make a CA + SuperLink TLS certificate")
    crt.add_argument("--out", required=True, help="output folder")
    crt.add_argument(
        "--host",
        action="append",
        required=True,
        help="DNS name or IP the SuperLink is reached at (repeat)",
    )
    crt.add_argument("--days", type=int, default=365)
    crt.add_argument("--force", action="store_true", help="replace existing files")
    keys = commands.add_parser("node-keys", help="make SuperNode auth key pairs")
    keys.add_argument("--out", required=True, help="output folder")
    keys.add_argument("--count", type=int, required=True)
    keys.add_argument("--force", action="store_true", help="replace existing files")
    mkd = commands.add_parser(
        "make-node-data",
        help="write one on-disk dataset per node from a task's data (node-config "
        "data-path), split with a run-config partitioner",
    )
    mkd.add_argument("--task", default="digits-mlp", help="task whose data to split")
    mkd.add_argument("--num-nodes", type=positive_int, required=True)
    mkd.add_argument(
        "--partitioner",
        help="run-config partition (iid, dirichlet, dirichlet-equal, shards, "
        "delta-sgd; default: the run config's)",
    )
    mkd.add_argument("--alpha", type=float, help="run-config dirichlet-alpha")
    mkd.add_argument("--seed", type=int, help="run-config seed of the partition")
    mkd.add_argument(
        "--run-config",
        help="further run-config keys, e.g. \"classes-per-client=2 data-dir='/d'\"",
    )
    mkd.add_argument(
        "--format",
        action="append",
        default=[],
        help="hf (Hugging Face save_to_disk, as flwr-datasets create writes), npz "
        "or imagefolder; several (comma-separated or repeated) are used in turn "
        "over the nodes (default: hf)",
    )
    mkd.add_argument(
        "--hf-arrays",
        action="store_true",
        help="hf: store model-ready arrays in a column x instead of images",
    )
    mkd.add_argument("--out", required=True, help="output folder (node-<i> inside)")
    mkd.add_argument("--force", action="store_true", help="replace an existing --out")
    cls = commands.add_parser(
        "clients",
        help="per node of a finished (or running) run: what the defences did to "
        "its replies (clients.jsonl), and the nodes that stand out",
    )
    cls.add_argument("run_dir", help="the run's folder (holds clients.jsonl)")
    cls.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.command == "make-node-data" and not args.format:
        args.format = ["hf"]
    raise_on_termination()  # SIGTERM/SIGHUP unwind too: stop what we started
    handlers = {
        "simulate": simulate,
        "deploy": deploy,
        "certs": certs,
        "node-keys": node_keys,
        "make-node-data": make_node_data,
        "clients": clients,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        # only reached when the stop was verified (ProcessesLeftError otherwise)
        print(
            "fedadapt: interrupted; every process started was stopped", file=sys.stderr
        )
        return 130
    except Terminated as stop:
        print(
            f"fedadapt: {stop.reason}; every process started was stopped",
            file=sys.stderr,
        )
        return int(stop.code or 1)
    except (ValueError, RuntimeError, TimeoutError, OSError) as error:
        print(f"fedadapt: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
