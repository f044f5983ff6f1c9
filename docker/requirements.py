"""Print the image's runtime requirements, derived from pyproject.toml.

The base dependencies plus the ``app`` extra (the image runs the app); where
both name a package (flwr), the app's pin.
The container runs SuperLink/SuperNode/SuperExec (no Ray simulation), so
``flwr[simulation]`` becomes plain ``flwr`` at the same pin; torch and
torchvision are left out because the Dockerfile installs them per variant
(``TORCH_SPEC``). One requirement per line, for ``pip install -r``.
"""

import re
import sys
import tomllib
from pathlib import Path

TORCH = ("torch", "torchvision")


def main() -> None:
    """Print the requirements of the pyproject next to this folder (or argv[1])."""
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1]
    project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    app = project["optional-dependencies"]["app"]
    pinned_by_app = {_name(r) for r in app}
    # a base requirement the app extra also names (flwr's range) gives way to
    # the app's pin: one line per package
    base = [r for r in project["dependencies"] if _name(r) not in pinned_by_app]
    printed = set()
    for requirement in [*base, *app]:
        line = requirement.replace("flwr[simulation]", "flwr")
        if _name(requirement) in TORCH or line in printed:
            continue
        printed.add(line)
        print(line)


def _name(requirement: str) -> str:
    """Return the distribution name a requirement string starts with."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    return match.group(0) if match else requirement


if __name__ == "__main__":
    main()
