"""Checks the whole checkout with ruff (lint and format), configured once in the root pyproject.toml.

Bazel runs this on the checkout itself rather than on declared inputs, so the target is tagged to run every time.
"""

import subprocess
import sys
from pathlib import Path


def _workspace_root(paths_sh: Path) -> Path:
    """The checkout's root, as the python_venv repository rule recorded it in paths.sh."""
    for line in paths_sh.read_text().splitlines():
        if line.startswith("WORKSPACE_ROOT="):
            return Path(line.split("=", 1)[1].strip("'"))
    raise SystemExit(f"{paths_sh} names no WORKSPACE_ROOT")


def main() -> int:
    root = _workspace_root(Path(sys.argv[1]))
    ruff = [sys.executable, "-m", "ruff"]
    lint = subprocess.run([*ruff, "check", "."], cwd=root)
    style = subprocess.run([*ruff, "format", "--check", "."], cwd=root)
    return lint.returncode or style.returncode


if __name__ == "__main__":
    sys.exit(main())
