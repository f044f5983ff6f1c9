"""fedadapt.strategies must import with flwr and numpy alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys
import fedadapt.strategies as s
import fedadapt.strategies.legacy
assert "torch" not in sys.modules, "torch imported"
print(s.FedAvg.__name__)
"""


def test_strategies_do_not_import_torch():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FedAvg"


def test_pip_install_fedadapt_needs_only_flwr_and_numpy():
    """Plug-in users install the base package; the app's stack is an extra."""
    import tomllib

    from packaging.requirements import Requirement

    from tests.helpers import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name for r in project["dependencies"]}
    assert base == {"flwr", "numpy"}
    app = {Requirement(r).name for r in project["optional-dependencies"]["app"]}
    assert {"torch", "torchvision", "flwr"} <= app


def _modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_no_import_loop_between_config_registry_and_the_app():
    """config reads the strategies' declarations, never the app's factory."""
    assert "fedadapt.config" not in _modules_after("import fedadapt.registry")
    loaded = _modules_after("import fedadapt.config")
    assert "fedadapt.server" not in loaded
    assert "fedadapt.config" not in _modules_after("import fedadapt.strategies")


@pytest.mark.app
def test_client_app_does_not_load_server_or_tools_modules():
    loaded = _modules_after("import fedadapt.client.client_app")
    packages = ("fedadapt.server", "fedadapt.tools",
                "matplotlib", "sklearn", "ray", "yaml",
                # a deployment pays every import per message (#40)
                "pandas", "scipy", "torchvision", "datasets", "flwr_datasets",
                "PIL", "pyarrow", "torch._dynamo")  # fmt: skip
    unwanted = {m for m in loaded for p in packages if m == p or m.startswith(p + ".")}
    assert unwanted == set()


def test_server_side_spells_no_wire_name():
    """#28 item 3: strategies and server import the wire names from wire.py.

    Any string constant (docstrings aside) equal to a distinctive wire name
    in fedadapt/strategies or fedadapt/server, outside wire.py, is a copy
    that can drift from the client's.
    """
    import ast

    from fedadapt.strategies import wire
    from tests.helpers import ROOT

    names = {wire.LR, wire.SERVER_ROUND, wire.NUM_EXAMPLES, wire.UPDATE_SQ_NORM,
             wire.LOCAL_ARRAYS, wire.PARTITION_ID, wire.NUM_PARTITIONS}  # fmt: skip
    found = []
    for package in ("strategies", "server"):
        for path in sorted((ROOT / "fedadapt" / package).rglob("*.py")):
            if path.name == "wire.py":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                and node.body
                and isinstance(node.body[0], ast.Expr)
            }
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and node.value in names
                and id(node) not in docstrings
            ]
    assert found == [], "use fedadapt.strategies.wire: " + "; ".join(found)
