"""fedadapt.strategies must import with flwr and numpy alone."""

from __future__ import annotations

import subprocess
import sys

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
