"""FedDuA + SCAFFOLD / Mime on DUA's synthetic linear regression, float64.

Why FedDuA Fig. 4's ordering does not hold on the synthetic task
(docs/reproduction.md, "FedDuA + SCAFFOLD and FedDuA + Mime"): an
independent NumPy re-run of ``conf/feddua-scaffold-mime-synthetic.yaml``
(20 clients, all per round, 20 full-batch GD steps, 30 rounds) written from
the algorithm boxes (SCAFFOLD option II, Karimireddy et al. 2020b, Alg. 1;
Mime with SGDm, Karimireddy et al. 2020a, Alg. 1, c of the previous round
as fedadapt's Mime; FedDuAdagrad with ε = ε_g = 0, DUA Alg. 1), printing
per run the loss (mean of the last 5 evaluations) and the medians of
FedDuA's step η and of the ratio A/‖Δ̄‖² = mean‖Δ_i‖²/‖mean Δ_i‖² it grows
with. ``--mime-fresh-c`` gives Mime the round's own c (the paper's extra
exchange). Runs in seconds: ``python benchmarks/feddua_local_updates_synthetic.py``.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from fedadapt.tasks.synthetic import linreg_grad, make_feddua_linreg

ROUNDS, STEPS, BETA = 30, 20, 0.9


def run(
    server: str,
    local: str,
    eta_l: float,
    eta_g: float = 1.0,
    seed: int = 0,
    fresh_c: bool = False,
) -> tuple[float, float, float]:
    """Return (loss of the last 5 rounds, median FedDuA η, median A/‖Δ̄‖²)."""
    x, y = make_feddua_linreg(seed)
    m_clients, n, d = x.shape

    def loss(w: np.ndarray) -> float:
        r = np.einsum("mnd,d->mn", x, w) - y
        return float(0.5 * np.mean(r**2))

    w = np.zeros(d)
    c, ci = np.zeros(d), np.zeros((m_clients, d))  # SCAFFOLD
    mom, c_mime = np.zeros(d), None  # Mime: server momentum, previous c
    s = np.zeros(d)  # FedDuAdagrad
    losses, etas, ratios = [], [], []
    for _ in range(ROUNDS):
        g_x = linreg_grad(w, x, y)  # every client's ∇f_i(x)
        if local == "mime" and fresh_c:
            c_mime = g_x.mean(axis=0)
        local_w = np.tile(w, (m_clients, 1))
        for _ in range(STEPS):
            g = linreg_grad(local_w, x, y)
            if local == "scaffold":
                g = g - ci + c
            elif local == "mime":
                if c_mime is not None:
                    g = g - g_x + c_mime
                g = (1 - BETA) * g + BETA * mom
            local_w -= eta_l * g
        deltas = local_w - w
        if local == "scaffold":
            ci_new = ci - c - deltas / (STEPS * eta_l)
            c = c + (ci_new - ci).mean(axis=0)
            ci = ci_new
        mean = deltas.mean(axis=0)
        a = float(np.mean(np.einsum("md,md->m", deltas, deltas)))
        ratios.append(a / float(mean @ mean))
        if server == "feddua":
            s += mean**2
            direction = np.divide(mean, np.sqrt(s), out=np.zeros(d), where=s > 0)
            eta = 0.5 * a / float(mean @ direction)
            etas.append(eta)
            new = w + eta * direction
            losses.append(loss(0.5 * (w + new)))  # average-last-two
        else:
            new = w + eta_g * mean
            losses.append(loss(new))
        w = new
        if local == "mime":
            c_mime = g_x.mean(axis=0) if not fresh_c else c_mime
            mom = (1 - BETA) * g_x.mean(axis=0) + BETA * mom
    eta_med = statistics.median(etas) if etas else float("nan")
    return float(np.mean(losses[-5:])), eta_med, statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mime-fresh-c", action="store_true")
    args = parser.parse_args()
    grid = [0.01, 0.0316, 0.1]
    runs = [("feddua", "none", lr, 1.0) for lr in grid]
    runs += [("fedavg", "scaffold", lr, g) for lr in grid for g in (1.0, 3.16, 10.0)]
    runs += [("feddua", "scaffold", lr, 1.0) for lr in grid]
    runs += [("fedavg", "mime", lr, 1.0) for lr in grid]
    runs += [("feddua", "mime", lr, 1.0) for lr in grid]
    print("server  local     eta_l   eta_g  loss(last5)  median-eta  median-A/|mean|^2")
    for server, local, lr, g in runs:
        result, eta, ratio = run(server, local, lr, g, fresh_c=args.mime_fresh_c)
        print(
            f"{server:7s} {local:9s} {lr:<7g} {g:<6g} {result:11.4g}  "
            f"{eta:10.3g}  {ratio:8.3g}"
        )


if __name__ == "__main__":
    main()
