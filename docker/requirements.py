"""Print the image's runtime requirements, derived from pyproject.toml.

The container runs SuperLink/SuperNode/SuperExec (no Ray simulation), so
``flwr[simulation]`` becomes plain ``flwr`` at the same pin; torch and
torchvision are left out because the Dockerfile installs them per variant
(``TORCH_SPEC``). One requirement per line, for ``pip install -r``.
"""

import sys
import tomllib
from pathlib import Path

TORCH = ("torch", "torchvision")


def main() -> None:
    """Print the requirements of the pyproject next to this folder (or argv[1])."""
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1]
    project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0]
        if name.strip() in TORCH:
            continue
        print(requirement.replace("flwr[simulation]", "flwr"))


if __name__ == "__main__":
    main()
