"""Two parts of a run's start-up, each against its old way in the same run (#39).

* **FAB build**: Flower's ``build_fab_from_disk`` on the app folder (what
  ``flwr run APP`` does, walking every file under it: in a checkout also
  ``.venv``, ``build/`` and ``outputs/``) against the same build on the
  lean copy ``submit_run`` now hands it (:func:`fedadapt.tools.submission.lean_app`,
  the copy included). Both must give the same FAB; the script checks it.
* **digits split**: a fresh process that loads the digits split with no
  cached file (scikit-learn imported, the split computed and written: the
  old way, and a machine's first time) against one that finds the file.

Best of ``--repeats`` each, printed with the ratio; ``--json`` writes them.

    .venv/bin/python benchmarks/startup_parts.py [--app .] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._output import write_json  # noqa: E402

#: the module (and torch) imported first: timed is what the cache changes
LOAD_DIGITS = (
    "import time; from fedadapt.tasks.digits import load_digits_split; "
    "t = time.perf_counter(); load_digits_split(); print(time.perf_counter() - t)"
)


def fab_build(app: Path, repeats: int) -> dict[str, float]:
    """Best seconds of Flower's FAB build from ``app`` and from its lean copy."""
    from flwr.cli.build import build_fab_from_disk

    from fedadapt.tools.submission import lean_app

    whole, lean, hashes = [], [], set()
    for _ in range(repeats):
        started = time.perf_counter()
        hashes.add(hashlib.sha256(build_fab_from_disk(app)).hexdigest())
        whole.append(time.perf_counter() - started)
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            copy = lean_app(app, Path(tmp) / "app")
            hashes.add(hashlib.sha256(build_fab_from_disk(copy)).hexdigest())
            lean.append(time.perf_counter() - started)
    if len(hashes) != 1:
        raise SystemExit("the lean copy built another FAB than the app folder")
    return {"app_folder_s": min(whole), "lean_copy_s": min(lean)}


def digits_split(repeats: int) -> dict[str, float]:
    """Best seconds of a fresh process loading the digits, without and with the file."""

    def one(cache: str) -> float:
        env = {**os.environ, "FEDADAPT_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, "-c", LOAD_DIGITS],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        return float(out.stdout.split()[-1])

    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(one(cache))  # no file: scikit-learn, then written
            warm.append(one(cache))  # the file read back
    return {"no_cached_file_s": min(cold), "cached_file_s": min(warm)}


def main(argv: list[str] | None = None) -> int:
    """Measure both parts, print them with their ratios, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", type=Path, default=ROOT)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    fab = fab_build(args.app.resolve(), args.repeats)
    digits = digits_split(args.repeats)
    print(
        f"FAB build: app folder {fab['app_folder_s']:.3f} s, lean copy "
        f"{fab['lean_copy_s']:.3f} s ({fab['app_folder_s'] / fab['lean_copy_s']:.0f}x)"
    )
    print(
        f"digits split, fresh process: no cached file {digits['no_cached_file_s']:.3f}"
        f" s, cached file {digits['cached_file_s']:.3f} s "
        f"({digits['no_cached_file_s'] / digits['cached_file_s']:.0f}x)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                },
                "fab_build": fab,
                "digits_split": digits,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
