"""The same Triton kernels compiled for CUDA at real serving shapes, against the references.

Run on a GPU machine with ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels/triton``; they
skip elsewhere (no CUDA, or the interpreter is on) with the reason.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test dependency: pip install -e '.[test]'")

from kernels.triton.checks import interpreting
from kernels.triton.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels.triton.kv_store import store_kv, store_kv_reference
from tests.kernels.triton.cases import TOLERANCE, blocks_needed, pools, shuffled_tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu: needs CUDA (none here)"),
    pytest.mark.skipif(
        interpreting(), reason="gpu: set TRITON_INTERPRET=0 so the kernels compile for CUDA"
    ),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_batch_64_context_4096(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    block_size, kv_heads, heads, dim = 16, 8, 32, 128
    lens = [4096, 1, 16, 17, *torch.randint(1, 4097, (60,), generator=g).tolist()]
    num_blocks = blocks_needed(lens, block_size) + 64
    k_pool, v_pool = pools(g, num_blocks, block_size, kv_heads, dim, dtype)
    table = shuffled_tables(g, lens, block_size, num_blocks, torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    args = [t.to(CUDA) for t in (q, k_pool, v_pool, table, ctx)]
    out = paged_decode_attention(*args, dim**-0.5)
    ref = paged_decode_attention_reference(q, k_pool, v_pool, table, ctx, dim**-0.5)
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[dtype])


def test_store_a_prefill_step_of_8192_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    block_size, kv_heads, dim, num_blocks = 16, 8, 128, 1024
    k_pool, v_pool = pools(g, num_blocks, block_size, kv_heads, dim, torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:8192]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = (torch.randn(8192, kv_heads, dim, generator=g).bfloat16() for _ in range(2))
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    store_kv_reference(ref_k, ref_v, k, v, blocks, offsets)
    out_k, out_v = k_pool.to(CUDA), v_pool.to(CUDA)
    store_kv(out_k, out_v, k.to(CUDA), v.to(CUDA), blocks.to(CUDA), offsets.to(CUDA))
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)
