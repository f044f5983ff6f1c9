"""FedAvg [McMahan et al., 2017] with reply screening.

Paper: arxiv.org/abs/1602.05629. Aggregation, sampling and configuration are
Flower's own ``flwr.serverapp.strategy.FedAvg``; this class only adds the
screening and per-round reports of :class:`ReplyScreening`.
"""

from __future__ import annotations

from flwr.serverapp import strategy as flwr_strategy

from fedadapt.strategies._screening import ReplyScreening


class FedAvg(ReplyScreening, flwr_strategy.FedAvg):
    """Flower's FedAvg that drops bad replies instead of failing the run.

    Takes exactly the arguments of ``flwr.serverapp.strategy.FedAvg``.
    """
