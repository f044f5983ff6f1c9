"""How much of a simulated round is Flower's polling (issue #30, item 2).

In Flower's simulation (1.41-1.42) two loops poll on fixed intervals:

* the simulation engine (``vce_api.add_messages_to_queue``) looks for new
  instructions in the LinkState every 0.1 s, one node at a time;
* the ServerApp's ``InMemoryGrid.send_and_receive`` looks for replies every
  ``pull_interval`` = 0.1 s.

A round therefore waits, on top of its training, for up to one interval of
each (0.1 s on average, 0.2 s at worst), and the engine's sweep visits every
node on each tick. This benchmark measures that share: it runs the minimal
Flower app and fedadapt on one protocol twice, back to back, through a
private simulation SuperLink each time: once with Flower as shipped, once
with both intervals shortened (``--poll``, default 0.005 s) by a
``sitecustomize`` that patches the two Flower functions in the processes
that SuperLink starts. fedadapt itself never patches Flower; this is a
measuring instrument. It prints the median round (rounds 2..N) of each and
the ratios shipped / shortened::

    python benchmarks/flower_polling.py --task digits-mlp --rounds 20
    python benchmarks/flower_polling.py --task mnist5k-cnn --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402
from benchmarks.simulation_floor import (  # noqa: E402
    MINIMAL,
    MINIMAL_KEYS,
    PROTOCOLS,
    flower_cell,
    machine,
)
from fedadapt.tools.submission import SimulationSuperLink  # noqa: E402

#: Patches Flower's two polling intervals when the variable is set; the
#: modules are patched right after they are first imported.
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, sys, importlib.abc, importlib.machinery

    POLL = os.environ.get("FEDADAPT_BENCH_FLOWER_POLL")
    TARGETS = {
        "flwr.superlink.grid.inmemory_grid",
        "flwr.server.superlink.fleet.vce.vce_api",
    }


    def _patch(module):
        poll = float(POLL)
        if module.__name__.endswith("inmemory_grid"):
            init = module.InMemoryGrid.__init__
            defaults = list(init.__defaults__)
            defaults[-1] = poll  # pull_interval, the last keyword
            init.__defaults__ = tuple(defaults)
        else:
            def add_messages_to_queue(state, queue, nodes_mapping, f_stop):
                while not f_stop.is_set():
                    for node_id in nodes_mapping.keys():
                        for msg in state.get_message_ins(node_id=node_id, limit=1):
                            queue.put(msg)
                    f_stop.wait(poll)

            module.add_messages_to_queue = add_messages_to_queue


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


    if POLL:
        sys.meta_path.insert(0, _Finder())
    """
)


def run(task: str, rounds: int, poll: float | None, tmp: Path) -> dict[str, Any]:
    """The minimal app and fedadapt through one SuperLink; ``poll`` patches."""
    base, num = PROTOCOLS[task]
    common = {"num-server-rounds": rounds}
    minimal = {k: base[k] for k in MINIMAL_KEYS}
    if base["partition"] == "delta-sgd":
        minimal["samples-per-client"] = base["samples-per-client"]
    saved = dict(os.environ)
    if poll is not None:
        os.environ["FEDADAPT_BENCH_FLOWER_POLL"] = repr(poll)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp / "site"), saved.get("PYTHONPATH")])
        )
    name = "shortened" if poll is not None else "shipped"
    try:
        with SimulationSuperLink(tmp / f"home-{name}") as link:
            out = {
                "minimal": flower_cell(
                    link,
                    MINIMAL,
                    {**minimal, **common, "output-dir": str(tmp / name / "m")},
                    num,
                    "",
                ),
                "fedadapt": flower_cell(
                    link,
                    ROOT,
                    {**base, **common, "output-dir": str(tmp / name / "f")},
                    num,
                    "",
                ),
            }
    finally:
        os.environ.clear()
        os.environ.update(saved)
    for app, result in out.items():
        print(
            f"{task} {app}, Flower's polling {name}: "
            f"{result['median_round_s']:.3f} s/round",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Both settings, back to back; print and optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(PROTOCOLS), default="digits-mlp")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--poll", type=float, default=0.005, help="shortened interval (s)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    info = machine("cpu")
    print(f"machine: {info}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fa-poll-") as name:
        tmp = Path(name)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        shipped = run(args.task, args.rounds, None, tmp)
        shortened = run(args.task, args.rounds, args.poll, tmp)
    print()
    print(f"| {args.task} | shipped (0.1 s) | shortened ({args.poll:g} s) | ratio |")
    print("|---|---|---|---|")
    ratios = {}
    for app in ("minimal", "fedadapt"):
        a = shipped[app]["median_round_s"]
        b = shortened[app]["median_round_s"]
        ratios[app] = round(a / b, 2)
        print(f"| {app} round (s) | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    if args.json:
        write_json(
            args.json,
            {
                "machine": info,
                "task": args.task,
                "rounds": args.rounds,
                "poll_s": args.poll,
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "shipped": shipped,
                "shortened": shortened,
                "ratios": ratios,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
