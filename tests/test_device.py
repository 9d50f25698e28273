"""`--device` and `--precision` mean the same in every command: one resolver each (tscale_p2p.device)."""

import pytest
import torch

from tscale_p2p.device import PRECISION_CHOICES, choose_precision, resolve_device
from tscale_p2p.errors import UserError
from tscale_p2p.kernels import PRECISIONS


def test_auto_and_cpu_resolve_and_bad_devices_are_one_clear_error():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "gpu0", "mps"):
        with pytest.raises(UserError, match=f"unknown device '{bad}'"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU is available"):
            resolve_device("cuda:0")


def test_auto_precision_follows_the_device_and_fp8_falls_back_where_it_cannot_run():
    assert PRECISION_CHOICES == ("auto", *PRECISIONS)
    assert choose_precision("auto", torch.device("cpu")) == "fp32"
    assert choose_precision("auto", torch.device("cuda")) == "bf16"
    assert choose_precision("fp8", torch.device("cpu")) == "bf16"
    with pytest.raises(UserError, match="unknown precision 'fp16'"):
        choose_precision("fp16", torch.device("cpu"))
