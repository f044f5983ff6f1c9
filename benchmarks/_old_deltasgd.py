"""``DeltaSGD`` as it was before #28 item 5, read from git history.

``benchmarks/optimizers.py`` (the rows "(old step)") and
``benchmarks/deltasgd_step_ab.py`` time the old ``DeltaSGD.step`` against
the new one in the same run. Rather than a frozen copy of 1,200 lines in the
tree, the old module is taken from commit :data:`BEFORE` with ``git show``
(needs this repository's history) and imported under a private name.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

#: main before #28 item 5 (fedadapt/client/optim/deltasgd.py at that commit)
BEFORE = "fdd8048"
SOURCE = "fedadapt/client/optim/deltasgd.py"
_ROOT = Path(__file__).resolve().parents[1]


def load() -> ModuleType:
    """Import the old Δ-SGD module (``git show BEFORE:SOURCE``)."""
    name = "_fedadapt_old_deltasgd"
    if name in sys.modules:
        return sys.modules[name]
    try:
        text = subprocess.run(
            ["git", "show", f"{BEFORE}:{SOURCE}"],
            cwd=_ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(
            f"the A/B baseline needs git history with commit {BEFORE} "
            f"(a full clone of the repository): {err}"
        ) from None
    folder = Path(tempfile.mkdtemp(prefix="old-deltasgd-"))
    path = folder / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


OldDeltaSGD = load().DeltaSGD
