"""Shared fixtures."""

from __future__ import annotations

import pytest

from fedadapt.config import validate_run_config


@pytest.fixture
def cfg():
    """A validated default run config; call with overrides."""

    def build(**overrides):
        return validate_run_config(
            {k.replace("_", "-"): v for k, v in overrides.items()}
        )

    return build
