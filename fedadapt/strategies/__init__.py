"""Server strategies for Flower (Message API).

Importable with flwr and numpy alone: nothing here imports torch.
"""

from fedadapt.strategies._screening import ReplyScreening, reject_reason
from fedadapt.strategies.fedavg import FedAvg

__all__ = ["FedAvg", "ReplyScreening", "reject_reason"]
