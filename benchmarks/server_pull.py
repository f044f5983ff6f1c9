"""The ServerApp's wait for replies in deployment, Flower's 3 s vs fedadapt's (#40).

In deployment Flower 1.42's ``HttpGrid.send_and_receive`` pulls replies
every 3 s; fedadapt's ServerApp pulls at 0.05 s doubling to 0.5 s
(:mod:`fedadapt.server.exchange`). This benchmark runs fedadapt on one real
``fedadapt deploy`` on loopback (a SuperLink and 2 SuperNodes as processes,
digits-mlp), alternating runs with Flower's loop (``flower``) and with
fedadapt's (``fedadapt``), and times every exchange inside the ServerApp
process:

* ``exchange_s``: push to return of ``send_and_receive``;
* ``after_last_reply_s``: return minus the ``created_at`` of the last reply
  (stamped by the ClientApp as it builds the reply, same clock on loopback):
  the wait after the last client finished, which holds the SuperNode's
  forwarding of the reply (its own 0.5-s poll, the same in both) and the
  ServerApp's pull delay (what changed);
* ``pulls``: ``pull_messages`` calls in the exchange;
* ``last_pull_gap_s``: from the end of the pull before the last one to the
  start of the last (which got the last reply): the reply reached the
  SuperLink somewhere in this gap, so it bounds the ServerApp's own delay
  (on average half of it), whatever the load does to the rest;
* ``push_to_first_clientapp_s``: push to the first ClientApp process start
  (the SuperNode's 3-s poll, the SuperExec's 1-s poll, the spawn);

and the round wall times of results.json. It prints medians per setting and
the ratios flower / fedadapt measured in the same invocation. How: a
``sitecustomize`` on the deployment's ``PYTHONPATH`` wraps both loops with
a timer and, for ``flower`` runs, makes ``fast_pull`` hand back Flower's
grid unchanged; a control file it reads when a ServerApp starts says which
setting the next run uses. fedadapt itself never patches anything; this is a
measuring instrument::

    python benchmarks/server_pull.py --rounds 3 --repeats 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402
from benchmarks.deployment import machine_load, round_times, settled_load  # noqa: E402
from benchmarks.simulation_floor import machine  # noqa: E402
from fedadapt.tools.submission import submit_run  # noqa: E402

CONFIG: dict[str, Any] = {
    "task": "digits-mlp",
    "strategy": "fedavg",
    "clients-per-round": 2,
    "local-steps": 8,
    "evaluate-every": 1,
    "clients-per-eval": 2,  # a federated-evaluate exchange each round too
}
NODES = 2
TIMEOUT = 1800.0
SETTINGS = ("flower", "fedadapt")

#: Loaded by every Python process of the deployment; acts only in the
#: ServerApp, when it imports the two grid loops.
SITECUSTOMIZE = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, os, sys, time

    LOG = os.environ.get("FEDADAPT_BENCH_PULL_LOG")
    CONTROL = os.environ.get("FEDADAPT_BENCH_PULL_CONTROL")
    PULLS = []  # (start, end, replies) of every HttpGrid.pull_messages


    def _setting():
        with open(CONTROL) as handle:
            return handle.read().strip()


    def _timed(loop, kind, module_file):
        def send_and_receive(*args, **kwargs):
            start, first = time.time(), len(PULLS)
            replies = list(loop(*args, **kwargs))
            end = time.time()
            made = [m.metadata.created_at for m in replies]
            with open(LOG, "a") as handle:
                handle.write(json.dumps({
                    "setting": _setting(), "loop": kind, "file": module_file,
                    "pid": os.getpid(), "start": start, "end": end,
                    "replies": len(replies), "pulls": len(PULLS) - first,
                    "pull_times": PULLS[first:],
                    "last_reply_created": max(made) if made else None,
                }) + "\\n")
            return replies
        return send_and_receive


    def _patch(module):
        if module.__name__ == "flwr.superlink.grid.http_grid":
            grid = module.HttpGrid
            pull = grid.pull_messages

            def pull_messages(self, message_ids):
                start = time.time()
                replies = list(pull(self, message_ids))
                PULLS.append((start, time.time(), len(replies)))
                return replies

            grid.pull_messages = pull_messages
            loop = grid.send_and_receive
            timed = _timed(loop, "flower", module.__file__)
            grid.send_and_receive = lambda self, messages, *, timeout=None: timed(
                self, messages, timeout=timeout)
        else:  # fedadapt.server.exchange
            if _setting() == "flower":
                module.fast_pull = lambda grid: grid
            module.exchange = _timed(module.exchange, "fedadapt", module.__file__)


    TARGETS = {"flwr.superlink.grid.http_grid", "fedadapt.server.exchange"}


    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec


    if LOG and CONTROL:
        sys.meta_path.insert(0, _Finder())
        if sys.argv and os.path.basename(sys.argv[0]) == "flwr-clientapp":
            with open(LOG, "a") as handle:  # a ClientApp process starts
                handle.write(json.dumps({"clientapp_start": time.time()}) + "\\n")
    """
)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarise(exchanges: list[dict[str, Any]], starts: list[float]) -> dict[str, Any]:
    """Medians over a setting's exchanges that got replies.

    ``starts`` are the times ClientApp processes started: the first one in
    an exchange, minus its push, is how long the message took to reach a
    ClientApp (the SuperNode's 3-s poll, the SuperExec's 1-s poll, spawn).
    """
    timed = [e for e in exchanges if e["replies"]]
    to_client = [
        min(t for t in starts if e["start"] <= t <= e["end"]) - e["start"]
        for e in timed
        if any(e["start"] <= t <= e["end"] for t in starts)
    ]
    # the last reply reached the SuperLink after the pull before the one that
    # got it had looked: this gap bounds the ServerApp's own delay
    gaps = [
        e["pull_times"][-1][0] - e["pull_times"][-2][1]
        for e in timed
        if len(e.get("pull_times", [])) >= 2
    ]
    return {
        "last_pull_gap_s": _median(gaps),
        "push_to_first_clientapp_s": _median(to_client),
        "exchanges": len(timed),
        "loops": sorted({e["loop"] for e in timed}),
        "exchange_s": _median([e["end"] - e["start"] for e in timed]),
        "after_last_reply_s": _median(
            [e["end"] - e["last_reply_created"] for e in timed]
        ),
        "mean_after_last_reply_s": round(
            statistics.fmean(e["end"] - e["last_reply_created"] for e in timed), 3
        )
        if timed
        else None,
        "pulls": _median([float(e["pulls"]) for e in timed]),
    }


def main(argv: list[str] | None = None) -> int:
    """Alternate the two settings on one deployment; print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    compile(SITECUSTOMIZE, "sitecustomize.py", "exec")  # a typo would time nothing
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    from fedadapt.tools.deploy.local import LocalDeployment

    saved = dict(os.environ)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="fa-pull-") as name:
        tmp = Path(name)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        log, control = tmp / "exchanges.jsonl", tmp / "setting"
        control.write_text("fedadapt")
        os.environ.update(
            FEDADAPT_BENCH_PULL_LOG=str(log),
            FEDADAPT_BENCH_PULL_CONTROL=str(control),
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(tmp / "site"), str(ROOT), saved.get("PYTHONPATH")])
            ),
        )
        try:
            load_before = settled_load()
            info = machine("cpu")
            print(f"machine: {info}", flush=True)
            if load_before["others"]:
                print(f"note, also running: {load_before['others']}", flush=True)
            with LocalDeployment(tmp / "deploy", NODES) as deployment:
                for i in range(args.repeats):
                    for setting in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
                        control.write_text(setting)
                        out = str(tmp / f"{setting}-{i}")
                        cfg = {
                            **CONFIG,
                            "num-server-rounds": args.rounds,
                            "output-dir": out,
                        }
                        outcome = submit_run(deployment, ROOT, cfg, NODES, TIMEOUT)
                        times = round_times(outcome, args.rounds)
                        runs[setting].append(times)
                        print(f"{setting} run {i}: rounds {times['round_s']}",
                              flush=True)  # fmt: skip
            load_after = machine_load()["loadavg"]
        finally:
            os.environ.clear()
            os.environ.update(saved)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e["clientapp_start"] for e in lines if "clientapp_start" in e]
    exchanges = [e for e in lines if "clientapp_start" not in e]
    if not exchanges:
        raise RuntimeError("no exchange was timed: the sitecustomize did not act")
    files = sorted({e["file"] for e in exchanges})
    print(f"loops timed in: {files}")
    found: dict[str, Any] = {}
    for setting in SETTINGS:
        mine = [e for e in exchanges if e["setting"] == setting]
        found[setting] = summarise(mine, starts)
        found[setting]["median_round_s"] = _median(
            [t for run in runs[setting] for t in run["round_s"][1:]]
        )
    print()
    print("| per exchange (median) | Flower's 3-s pull | fedadapt's pull | ratio |")
    print("|---|---|---|---|")
    ratios = {}
    for key in ("last_pull_gap_s", "exchange_s", "push_to_first_clientapp_s",
                "after_last_reply_s",
                "mean_after_last_reply_s", "pulls", "median_round_s"):  # fmt: skip
        a, b = found["flower"][key], found["fedadapt"][key]
        ratio = round(a / b, 2) if a and b else None
        ratios[key] = ratio
        print(f"| {key} | {a} | {b} | {ratio} |")
    for setting in SETTINGS:
        timed = found[setting]
        print(f"{setting}: {timed['exchanges']} exchanges, loops {timed['loops']}")
    print(f"load average before {load_before['loadavg']}, after {load_after}")
    if args.json:
        write_json(
            args.json,
            {
                "config": {**CONFIG, "num-server-rounds": args.rounds, "nodes": NODES},
                "machine": info,
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "load_before": load_before,
                "loadavg_after": load_after,
                "runs": runs,
                "exchanges": exchanges,
                "clientapp_starts": starts,
                "summary": found,
                "ratios": ratios,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
