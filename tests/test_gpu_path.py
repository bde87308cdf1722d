"""The parts of the CUDA path that can be checked without a GPU.

The TF32 switches exist in the CPU build of torch too, so turning TF32 off and
reading it back is tested here; the rest of the GPU path is bench/gpu_check.sh,
run on a GPU node.
"""

from __future__ import annotations

import pytest
import torch

from stagereplay.engines.transformers_engine import _disable_tf32, tf32_enabled


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


@pytest.mark.parametrize("layers", [1, 12, 130])
def test_cache_digest_is_the_stored_object_id(layers):
    from stagereplay.ledger.fingerprint import fingerprint_cache, fingerprint_tensors
    from stagereplay.ledger.kvstate import KVState

    generator = torch.Generator().manual_seed(layers)
    keys = tuple(torch.randn(1, 2, 3, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    values = tuple(torch.randn(1, 2, 3, 4, generator=generator).to(torch.bfloat16) for _ in range(layers))
    state = KVState(keys, values)
    # The digest is built from the layer digests; it must equal the id the store derives from the tensors.
    assert fingerprint_cache(state).digest == fingerprint_tensors(state.named_tensors())
