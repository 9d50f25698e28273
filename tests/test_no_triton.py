"""Where Triton is not installed (macOS, ARM, torch's CPU build), everything but the fp8/int8 kernels still runs:
`join`'s modules import, the 1-bit codec packs with plain torch, and `train` and `infer` work end to end."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap

import pytest

# Run inside an interpreter whose site-packages is this one's minus Triton: a folder of links to every entry but
# triton's (`python -S`, then that folder as the site dir, so .pth files, the editable install's among them,
# still load). `import triton` then fails and `importlib.util.find_spec("triton")` is None, as on a machine
# that never had it.
SCRIPT = textwrap.dedent("""
    import importlib, importlib.util, site, sys
    site.addsitedir(sys.argv[1])
    out = sys.argv[2]
    assert importlib.util.find_spec("triton") is None
    try:
        import triton
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("triton imported")

    import torch
    import tscale_p2p.cli.swarm, tscale_p2p.peers.join  # what `tscale-peer join` loads before it trains
    from tscale_p2p.peers.codec import OneBitCodec
    from tscale_p2p.cli import main

    # The 1-bit codec of every averaging round, on the CPU path
    codec = OneBitCodec()
    x = torch.randn(1000)
    restored = codec.extract(codec.compress(x, info=None))
    assert restored.shape == x.shape and torch.equal(restored.sign(), x.sign())

    assert main(["train", "--model", "e32h2d2w32", "--steps", "3", "--batch-size", "2", "--eval-every", "0",
                 "--eval-batches", "1", "--warmup", "0", "--out", out, "--data", sys.argv[3]]) == 0
    assert main(["infer", "--checkpoint", out, "--prompt", "ab", "--max-tokens", "4", "--seed", "0"]) == 0
    assert "triton" not in sys.modules, sorted(m for m in sys.modules if m.startswith("triton"))
    print("NO-TRITON-OK")
""")


def site_packages_without_triton(folder) -> str:
    [packages] = [p for p in site.getsitepackages() if os.path.isdir(os.path.join(p, "torch"))]
    folder.mkdir()
    for name in os.listdir(packages):
        if not name.lower().startswith("triton"):
            os.symlink(os.path.join(packages, name), folder / name)
    return str(folder)


@pytest.mark.slow
def test_join_imports_and_train_and_infer_run_without_triton(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    packages = site_packages_without_triton(tmp_path / "site-packages")
    result = subprocess.run(
        [sys.executable, "-S", "-c", SCRIPT, packages, str(tmp_path / "run"), str(corpus)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert result.returncode == 0 and "NO-TRITON-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
