"""Builds one package's wheel with a standard PEP 517 build, for the `pep517_wheel` Bazel rule.

rules_python's `py_wheel` cannot be downloaded here, so the wheel comes from the package's own pyproject.toml
through pypa/build, run without build isolation (setuptools comes from the dev environment, no network). The
package's files are copied to a scratch folder first so the build leaves nothing in the source tree, and the
timestamps inside the wheel are pinned so the same sources give the same bytes.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package-dir", required=True, help="the folder holding pyproject.toml")
    parser.add_argument("--out", required=True, help="the wheel file Bazel expects")
    parser.add_argument("sources", nargs="+", help="the package's files, as paths under the execution root")
    args = parser.parse_args()
    package_dir = Path(args.package_dir)
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "src"
        for source in map(Path, args.sources):
            target = tree / source.relative_to(package_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        dist = Path(scratch) / "dist"
        env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
        build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(tree)]
        done = subprocess.run(build, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
            return done.returncode
        built = sorted(dist.glob("*.whl"))
        expected = Path(args.out).name
        if [wheel.name for wheel in built] != [expected]:
            print(
                f"build_wheel: built {[w.name for w in built]}, but the BUILD file declares {expected};"
                " keep the version in BUILD.bazel and pyproject.toml the same",
                file=sys.stderr,
            )
            return 1
        shutil.copyfile(built[0], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
