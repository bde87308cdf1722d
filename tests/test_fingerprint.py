import subprocess
import sys

import pytest
import torch

from stagereplay.ledger.fingerprint import combine, fingerprint_tensor, fingerprint_tensors, fingerprint_tokens

SCRIPT = (
    "import torch; from stagereplay.ledger.fingerprint import fingerprint_tensor;"
    "g = torch.Generator().manual_seed(7);"
    "print(fingerprint_tensor(torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)))"
)


def seeded(dtype=torch.float32):
    generator = torch.Generator().manual_seed(7)
    return torch.randn(3, 5, 7, generator=generator).to(dtype)


def test_fingerprint_is_stable_across_processes():
    here = fingerprint_tensor(seeded(torch.bfloat16))
    outputs = {
        subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert outputs == {here}
    assert len(here) == 32 and int(here, 16) >= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_one_bit_flip_changes_the_fingerprint(dtype):
    tensor = seeded(dtype) if dtype.is_floating_point else torch.arange(105).reshape(3, 5, 7)
    flipped = tensor.clone()
    flipped.view(torch.uint8).reshape(-1)[17] ^= 0x01
    assert not torch.equal(tensor.view(torch.uint8), flipped.view(torch.uint8))
    assert fingerprint_tensor(tensor) != fingerprint_tensor(flipped)
    assert fingerprint_tensor(tensor) == fingerprint_tensor(tensor.clone())


def test_dtype_and_shape_are_folded_in():
    tensor = seeded()
    same_bytes_other_dtype = tensor.view(torch.int32)
    same_bytes_other_shape = tensor.reshape(5, 3, 7)
    assert tensor.view(torch.uint8).equal(same_bytes_other_dtype.view(torch.uint8))
    digests = {fingerprint_tensor(t) for t in (tensor, same_bytes_other_dtype, same_bytes_other_shape)}
    assert len(digests) == 3


def test_non_contiguous_tensor_hashes_as_its_canonical_layout():
    tensor = seeded()
    transposed = tensor.transpose(0, 2)
    assert not transposed.is_contiguous()
    assert fingerprint_tensor(transposed) == fingerprint_tensor(transposed.contiguous())
    assert fingerprint_tensor(transposed) != fingerprint_tensor(tensor)


def test_named_digest_depends_on_names_order_free_and_content():
    a, b = seeded(), seeded() + 1
    assert fingerprint_tensors({"x": a, "y": b}) == fingerprint_tensors({"y": b, "x": a})
    assert fingerprint_tensors({"x": a, "y": b}) != fingerprint_tensors({"x": b, "y": a})
    assert combine([("a", "1")]) != combine([("a", "2")])


def test_token_fingerprint_distinguishes_sequences():
    assert fingerprint_tokens([1, 2, 3]) == fingerprint_tokens((1, 2, 3))
    assert fingerprint_tokens([1, 2, 3]) != fingerprint_tokens([1, 2, 4])
    assert fingerprint_tokens([1, 2]) != fingerprint_tokens([1, 2, 0])
