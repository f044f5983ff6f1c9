"""fedadapt: adaptive federated optimization for Flower."""

__version__ = "0.1.0"
