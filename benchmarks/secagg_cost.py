"""What SecAgg+ costs (issue #41 item 6): a secure round against a plain one.

Same app, config and machine, one after the other: digits-mlp, FedExP, 3
clients all sampled, 10 local steps, central evaluation each round, 4
rounds, ``secure-aggregation`` ``off`` then ``secagg+`` (the default apps:
the secure run goes through Flower's legacy SecAgg+ workflow, four
exchanges a round). Per mode (``simulation``: ``fedadapt simulate``'s
private simulation SuperLink; ``processes``: ``fedadapt deploy``'s SuperLink
and 3 SuperNodes on loopback) the median steady round (rounds 2..N, from
results.json) of both and their ratio.

Bytes: one more pair of short runs in this process (Flower's in-process
``run_simulation``) with the ClientApp wrapped so that every message a
client receives and every reply it sends is serialised as Flower sends it
(``message_to_proto(...).ByteSize()``), summed per client and round.

    .venv/bin/python benchmarks/secagg_cost.py [--rounds 4] \\
        [--modes simulation processes]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402
from benchmarks.deployment import round_times, settled_load  # noqa: E402
from fedadapt.tools.submission import SimulationSuperLink, submit_run  # noqa: E402

CONFIG: dict[str, Any] = {
    "task": "digits-mlp",
    "strategy": "fedexp",
    "clients-per-round": 3,
    "local-steps": 10,
    "evaluate-every": 1,
}
CLIENTS = 3
MODES_SECURE = {"plain": "off", "secagg+": "secagg+"}


def timed_pair(target: Any, work: Path, rounds: int) -> dict[str, Any]:
    """Round times of the plain and the secure run on ``target``, and the ratio."""
    found: dict[str, Any] = {}
    for name, mode in MODES_SECURE.items():
        cfg = {**CONFIG, "num-server-rounds": rounds, "secure-aggregation": mode,
               "output-dir": str(work / name)}  # fmt: skip
        found[name] = round_times(
            submit_run(target, ROOT, cfg, CLIENTS, 1800.0), rounds
        )
    found["secure_vs_plain"] = round(
        found["secagg+"]["median_round_s"] / found["plain"]["median_round_s"], 2
    )
    return found


def simulation(work: Path, rounds: int) -> dict[str, Any]:
    with SimulationSuperLink(work / "home") as link:
        return timed_pair(link, work, rounds)


def processes(work: Path, rounds: int) -> dict[str, Any]:
    from fedadapt.tools.deploy.local import LocalDeployment

    with LocalDeployment(work / "deploy", CLIENTS) as deployment:
        return timed_pair(deployment, work, rounds)


def message_bytes(work: Path, rounds: int = 2) -> dict[str, Any]:
    """Bytes each client receives and sends per round, plain and secure."""
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.common.serde import message_to_proto
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedadapt.client import client_app
    from fedadapt.server import server_app

    found: dict[str, Any] = {}
    for name, mode in MODES_SECURE.items():
        run_config = {**CONFIG, "num-server-rounds": rounds, "evaluate-every": 0,
                      "secure-aggregation": mode, "output-dir": str(work / "bytes"),
                      "run-name": name}  # fmt: skip
        # the clients run in Ray actors (other processes): one line per message
        tally = work / f"{name}.tally"
        tally.parent.mkdir(parents=True, exist_ok=True)
        tally.write_text("")
        server = ServerApp()

        @server.main()
        def _main(grid: Any, context: Context, cfg: dict = run_config) -> None:
            context.run_config.clear()
            context.run_config.update(cfg)
            server_app.main(grid, context)

        client = ClientApp()

        def counted(handler: Any, cfg: dict = run_config, out: Path = tally) -> Any:
            def handle(msg: Any, context: Context) -> Any:
                ctx = Context(
                    context.run_id, context.node_id, context.node_config,
                    context.state, dict(cfg),
                )  # fmt: skip
                reply = handler(msg, ctx)
                sizes = (message_to_proto(msg).ByteSize(),
                         message_to_proto(reply).ByteSize())  # fmt: skip
                with out.open("a") as f:
                    f.write(f"{sizes[0]} {sizes[1]}\n")
                return reply

            return handle

        client.train()(counted(client_app.train))
        client.evaluate()(counted(client_app.evaluate))
        client.query()(counted(client_app.query))
        run_simulation(
            server_app=server,
            client_app=client,
            num_supernodes=CLIENTS,
            backend_config={"client_resources": {"num_cpus": 1}},
        )
        sizes = [
            tuple(map(int, line.split()))
            for line in tally.read_text().split("\n")
            if line
        ]
        per = CLIENTS * rounds
        found[name] = {
            "received_per_client_round": round(sum(r for r, _ in sizes) / per),
            "sent_per_client_round": round(sum(s for _, s in sizes) / per),
            "messages_per_client_round": round(len(sizes) / per, 2),
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["simulation", "processes"],
                        choices=["simulation", "processes"])  # fmt: skip
    default = ROOT / "benchmarks/results/secagg-cost.json"
    parser.add_argument("--output", type=Path, default=default)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fa-secagg-") as tmp:
        for mode in args.modes:
            load = settled_load()
            started = time.monotonic()
            run = simulation if mode == "simulation" else processes
            results[mode] = {**run(Path(tmp) / mode, args.rounds), "load_before": load}
            print(
                f"{mode}: {time.monotonic() - started:.0f}s {results[mode]}", flush=True
            )
        results["bytes"] = message_bytes(Path(tmp) / "bytes")
    print("\n| mode | plain round (s) | SecAgg+ round (s) | SecAgg+ / plain |")
    print("|---|---|---|---|")
    for mode in args.modes:
        r = results[mode]
        plain, secure = r["plain"]["median_round_s"], r["secagg+"]["median_round_s"]
        print(f"| {mode} | {plain:.2f} | {secure:.2f} | {r['secure_vs_plain']:.2f}x |")
    print("\n| | bytes received / client / round | bytes sent | messages |")
    print("|---|---|---|---|")
    for name, b in results["bytes"].items():
        cells = (b["received_per_client_round"], b["sent_per_client_round"],
                 b["messages_per_client_round"])  # fmt: skip
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |")
    write_json(args.output, {
        "config": {**CONFIG, "num-server-rounds": args.rounds, "clients": CLIENTS},
        "machine": {"platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    })  # fmt: skip
    print(f"\nwritten: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
