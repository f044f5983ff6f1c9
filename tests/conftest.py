"""Shared fixtures."""

from __future__ import annotations

import os

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


@pytest.fixture
def task_identity():
    """Messages built outside a run need a run identity (Flower sets it in one)."""
    from fedadapt.strategies.identity import task_identity as identity

    with identity():
        yield


@pytest.fixture(autouse=True, scope="session")
def partition_cache(tmp_path_factory):
    """Keep computed partitions (and every process the tests start) out of ~/.cache."""
    os.environ["FEDADAPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("fedadapt-cache"))


@pytest.fixture(autouse=True)
def keep_pythonpath():
    """Undo Flower's write of the driver's sys.path into ``PYTHONPATH``.

    Flower's Ray backend (``RayBackend.init_ray``) sets ``os.environ
    ["PYTHONPATH"]`` to this process's ``sys.path`` and leaves it there, so
    every later subprocess of the test session, system tools such as
    ``docker-compose`` included, would import this virtualenv's packages.
    """
    saved = os.environ.get("PYTHONPATH")
    yield
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(autouse=True)
def keep_flower_object_pull():
    """Undo a test's ServerApp shortening Flower's object-pull retry.

    ``fedadapt.server.exchange.fast_pull`` sets the first retry of Flower's
    object pulls for the whole process (``fedadapt.server.object_pull``); a
    test that builds a deployment ServerApp must not change it for the next.
    """
    try:
        from flwr.supercore.inflatable import inflatable_utils as utils
    except ImportError:  # another Flower: nothing of ours to undo
        yield
        return
    functions = (utils.pull_objects, utils.pull_and_inflate_object_from_tree)
    saved = [dict(f.__kwdefaults__ or {}) for f in functions]
    yield
    for function, defaults in zip(functions, saved, strict=True):
        if function.__kwdefaults__ is not None:
            function.__kwdefaults__.clear()
            function.__kwdefaults__.update(defaults)
