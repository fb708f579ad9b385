"""The torch references of the paged KV kernels: the plain code each kernel is checked
against, and what the engine runs where no kernel applies.

- ``write_kv``: a step's keys and values into their slots (the Triton ``store_kv``, the
  KV write of the C++ ``layer_ops.rope_write_kv``);
- ``decode_attention_reference``: one query per sequence over its paged context (the C++
  ``paged_attention.decode_attention_cpu`` and the Triton ``paged_decode_attention``).

They take plain tensors and ints, the kernels' own signatures, so ``kernels/`` needs
nothing from ``engine/``: the engine adapts its batch types at the call site.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store new tokens' keys/values (``[T, kv_heads, head_dim]``) into their slots, cast
    to the pool's dtype (rounded to nearest even)."""
    k_pool[slot_blocks, slot_offsets] = k.to(k_pool.dtype)
    v_pool[slot_blocks, slot_offsets] = v.to(v_pool.dtype)


class Workspace:
    """Scratch buffers reused across layers and steps (grow, never shrink).

    Why: a fresh multi-megabyte tensor per layer is a fresh mmap, and its page faults cost
    more than the gather that fills it.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


def decode_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: Workspace | None = None,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence (``q``: ``[B, heads, head_dim]``) over its paged context:
    row ``b``'s first ``context_lens[b]`` tokens live in the blocks ``block_tables[b]``
    (int64 ``[B, max_blocks]``) names, in order. Pools are one layer's
    ``[num_blocks, block_size, kv_heads, head_dim]``, read as stored and widened to ``q``'s
    dtype. ``max_context_len``: ``context_lens``' maximum when the caller knows it on the
    host (else it is read from the tensor)."""
    b, heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    max_len = int(context_lens.max()) if max_context_len is None else max_context_len
    flat = block_tables.reshape(-1)
    ws = workspace or Workspace(q.device)
    gathered = (flat.numel(), *k_pool.shape[1:])
    kbuf = ws.get("k", gathered, k_pool.dtype)
    vbuf = ws.get("v", gathered, v_pool.dtype)
    # index_select on whole blocks is the cheapest gather torch has on CPU; the
    # [B, T, kv, D] -> [B, kv, T, D] transpose stays a view that SDPA reads with strides.
    torch.index_select(k_pool, 0, flat, out=kbuf)
    torch.index_select(v_pool, 0, flat, out=vbuf)
    keys = kbuf.view(b, -1, kv_heads, dim)[:, :max_len].transpose(1, 2).to(q.dtype)
    values = vbuf.view(b, -1, kv_heads, dim)[:, :max_len].transpose(1, 2).to(q.dtype)
    mask = None
    if int(context_lens.min()) < max_len:
        lens = context_lens.unsqueeze(1)
        mask = (torch.arange(max_len, device=lens.device) < lens).view(b, 1, 1, max_len)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.view(b, heads, dim)
