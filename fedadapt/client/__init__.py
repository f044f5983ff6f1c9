"""Client side: local training, optimizers and the Flower ClientApp."""
