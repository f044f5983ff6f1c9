"""Print the image's runtime requirements, derived from pyproject.toml.

The base dependencies plus the ``app`` extra (the image runs the app).
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
    wanted = [*project["dependencies"], *project["optional-dependencies"]["app"]]
    printed = set()
    for requirement in wanted:
        name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0]
        line = requirement.replace("flwr[simulation]", "flwr")
        if name.strip() in TORCH or line in printed:
            continue
        printed.add(line)
        print(line)


if __name__ == "__main__":
    main()
