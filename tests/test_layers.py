"""The package's layers hold: pyproject.toml's import-linter contracts, as `.ci/check_layers.py` checks them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_point_one_way_and_the_trainer_imports_no_network_stack():
    result = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_layers.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout
