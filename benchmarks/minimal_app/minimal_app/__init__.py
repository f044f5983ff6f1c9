"""Minimal Flower PyTorch app (the deployment benchmark's baseline)."""
