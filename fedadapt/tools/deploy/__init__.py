"""Deployment helpers: certificates, keys and local SuperLink/SuperNode processes."""
