"""The parts of the CUDA path that can be checked without a GPU.

The TF32 switches exist in the CPU build of torch too, so turning TF32 off and
reading it back is tested here; the rest of the GPU path is bench/gpu_check.sh,
run on a GPU node.
"""

from __future__ import annotations

import pytest
import torch

from stagereplay.model import _disable_tf32, tf32_enabled


@pytest.fixture
def restore_tf32():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        saved = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        yield
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision)
    yield
    matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = saved


def test_tf32_off_is_read_back_as_off(restore_tf32):
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32"  # as a library or a user might have set it before us
    else:
        matmul.allow_tf32 = True
    assert tf32_enabled()
    _disable_tf32()
    assert not tf32_enabled()
    if hasattr(matmul, "fp32_precision"):
        assert matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"


def test_a_convolution_left_on_tf32_counts_as_tf32(restore_tf32):
    _disable_tf32()
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    else:
        torch.backends.cudnn.allow_tf32 = True
    assert tf32_enabled()
