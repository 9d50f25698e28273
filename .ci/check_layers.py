"""Check pyproject.toml's import-linter contracts (the layers) against the package as it installs.

import-linter reads a package from the file system, and an editable install assembles `tscale_p2p` from its
folders (setuptools' package-dir) only at import time, so it would see the core folder alone. This copies the
folders into the installed layout in a temporary directory and lints that. Exit code: lint-imports'.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    pyproject = ROOT / "pyproject.toml"
    package_dir = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory() as tree:
        for package, folder in package_dir.items():  # parents first: "tscale_p2p" comes before its subpackages
            shutil.copytree(ROOT / folder, Path(tree, *package.split(".")),
                            ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        # Run from the copy: the console script puts its own folder first on sys.path, then PYTHONPATH, so the
        # copy shadows the editable install; its cache stays in the temporary directory.
        lint = Path(sys.executable).with_name("lint-imports")
        env = {"PYTHONPATH": tree, "PATH": str(lint.parent)}
        return subprocess.run([str(lint), str(pyproject)], cwd=tree, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
