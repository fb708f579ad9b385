"""Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights arrive with Hugging Face names (``engine/checkpoint.py``) and are fused here:
q/k/v into one projection and gate/up into another, so a layer is four matrix products.
A dense weight is a ``kernels.linear.PackedLinear`` (pre-packed for oneDNN on float32 CPU);
a GGUF matrix kept as packed blocks a ``kernels.quant_linear.QuantLinear`` (dequantized in
registers); parts of different types (a Q4_K q beside a Q6_K v) run side by side.
The forward pass takes a flat ``ForwardBatch`` (all sequences' new tokens concatenated)
and reads/writes keys and values in the paged pool (``engine/kv_cache.py``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import decode_attention, prefill_attention
from engine.config import ModelConfig
from engine.forward_batch import DecodeBatch, ForwardBatch
from engine.gguf_loader import Weight
from engine.kv_cache import KVCache
from engine.rope import RotaryEmbedding
from kernels import layer_ops
from kernels.linear import PackedLinear
from kernels.paged_attention import check_decode_ranges, cpu_kernel_available
from kernels.quant_linear import KERNEL_TYPES, QuantizedWeight, QuantLinear, dequantize_rows
from kernels.reference import Workspace, write_kv

Linear = PackedLinear | QuantLinear


class _Stacked:
    """Parts whose weights cannot be stacked into one (different types) run in turn and
    their outputs are concatenated: the same result as one stacked product."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def _linear(parts: list[Weight], pack: bool | None, kernel: str = "auto") -> Linear | _Stacked:
    """One product over the rows of ``parts`` stacked (q, k, v; gate, up)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        dense = [p for p in parts if isinstance(p, torch.Tensor)]
        return PackedLinear(dense[0] if len(dense) == 1 else torch.cat(dense, dim=0), pack=pack)
    packed = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(packed) == len(parts) and len({(p.qtype, p.shape[1]) for p in packed}) == 1:
        weight = QuantizedWeight.concat(packed) if len(packed) > 1 else packed[0]
        return QuantLinear(weight, kernel=kernel)
    return _Stacked([_linear([p], pack, kernel) for p in parts])  # type: ignore[misc]


class _Layer:
    __slots__ = ("attn_norm", "down", "gate_up", "mlp_norm", "o", "qkv")

    def __init__(self, t: dict[str, Weight], i: int, pack: bool | None, kernel: str) -> None:
        p = f"model.layers.{i}."
        self.attn_norm = _dense(t[p + "input_layernorm.weight"])
        self.mlp_norm = _dense(t[p + "post_attention_layernorm.weight"])
        qkv = [t[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        self.qkv = _linear(qkv, pack, kernel)
        self.o = _linear([t[p + "self_attn.o_proj.weight"]], pack, kernel)
        gate_up = [t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]
        self.gate_up = _linear(gate_up, pack, kernel)
        self.down = _linear([t[p + "mlp.down_proj.weight"]], pack, kernel)

    def linears(self) -> list[Linear]:
        out: list[Linear] = []
        for m in (self.qkv, self.o, self.gate_up, self.down):
            out.extend(m.parts if isinstance(m, _Stacked) else [m])
        return out

    @property
    def nbytes(self) -> int:
        norms = _tensor_bytes(self.attn_norm) + _tensor_bytes(self.mlp_norm)
        return norms + sum(m.nbytes for m in self.linears())


def check_ranges(batch: ForwardBatch, max_positions: int, pool_blocks: torch.Size) -> None:
    """Every index of a host batch lies inside the RoPE tables and the pool
    (``[num_blocks, block_size]``): positions, KV slots, decode block tables and context
    lengths, prefill block tables. On a GPU an index out of range is memory corruption or
    a device assert that kills the process, never an exception, so it is checked here."""
    layer_ops.check_slot_ranges(
        batch.positions, batch.slot_blocks, batch.slot_offsets, max_positions, pool_blocks
    )
    if batch.decode is not None:
        d = batch.decode
        check_decode_ranges(d.block_tables, d.context_lens, *pool_blocks)
    for seg in batch.prefills:
        table = seg.block_table
        fits = table.numel() * pool_blocks[1] >= seg.context_len + seg.length
        inside = table.numel() == 0 or 0 <= int(table.min()) <= int(table.max()) < pool_blocks[0]
        if not (fits and inside):
            raise ValueError("a prefill segment's block table is out of range for the pool")


def _triton_ops() -> types.SimpleNamespace:
    """The Triton launchers, imported only by an engine that runs them (triton is not a
    dependency of the CPU engine)."""
    from kernels.triton.decode_attention import paged_decode_attention
    from kernels.triton.kv_store import store_kv

    return types.SimpleNamespace(paged_decode_attention=paged_decode_attention, store_kv=store_kv)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense(weight: Weight) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        raise TypeError("norm weights are dense tensors")
    return weight


class LlamaModel:
    """Inference-only Llama decoder. Not thread-safe: one engine loop drives it.

    Everything it holds lives on ``device`` (weights, RoPE tables). ``forward``
    takes a batch built on the host, checks its indices there, and uploads it once.

    ``cpu_kernels=False`` keeps to the torch reference: plain ``F.linear`` and the gathered
    attention, never the packed oneDNN weights or the C++ attention kernel (both apply on
    the CPU only). ``triton_kernels`` runs decode attention and the KV store as the Triton
    kernels of ``kernels/triton`` (the CUDA path; on the CPU only under triton's
    interpreter, which is how the tests run it).

    ``batch_invariant``: a token's keys, values and logits are the same bits whatever else
    the step holds, and whether it came in a prompt (of any length, in any chunk, after
    any cached prefix) or in a decode step. Every product runs the tiled quantized kernel,
    whose row results do not depend on the batch (``kernels.quant_linear``), and every
    token's attention runs the paged decode kernel as one query over its own context
    (``ForwardBatch.as_decode_rows``); the layer ops are row by row already. So a prompt
    plus the tokens decoded after it, prefilled again on any worker, gives the KV the
    decode steps wrote: a migrated stream continues exactly (docs/operations.md). It
    needs packed quantized weights for every product and the CPU kernels; ``ValueError``
    says which is missing."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, Weight],
        *,
        cpu_kernels: bool = True,
        device: torch.device | str = "cpu",
        triton_kernels: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        if not on_cpu:
            if any(isinstance(t, QuantizedWeight) for t in tensors.values()):
                raise ValueError(f"packed quantized weights run on the CPU, not {self.device}")
            tensors = {name: _dense(t).to(self.device) for name, t in tensors.items()}
        self.cpu_kernels = cpu_kernels and on_cpu
        self.triton = _triton_ops() if triton_kernels else None
        pack = None if self.cpu_kernels else False  # None: PackedLinear packs where it can
        self.batch_invariant = batch_invariant
        kernel = "tiled" if batch_invariant else "auto"
        self.norm = _dense(tensors["model.norm.weight"])
        self.dtype = self.norm.dtype
        # A packed embedding is looked up row by row (``dequantize_rows``); a dense one is a
        # table. Tied heads share a packed embedding; a dense one gets its own packed copy.
        self.embed = tensors["model.embed_tokens.weight"]
        head = self.embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        self.lm_head = _linear([head], pack, kernel)
        self.layers = [_Layer(tensors, i, pack, kernel) for i in range(config.num_layers)]
        if self.dtype != torch.float32 and any(
            isinstance(t, QuantizedWeight) for t in tensors.values()
        ):
            raise ValueError("packed quantized weights compute in float32 only")
        self.rope = RotaryEmbedding(config, self.dtype, self.device)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.eps = config.rms_norm_eps
        self.workspace = Workspace(self.device)
        # The fused C++ layer ops (norms, RoPE + KV write, SiLU) replace dozens of small torch
        # ops per layer, which cost as much as the products at decode batch sizes.
        self.fused = (
            self.cpu_kernels
            and self.triton is None
            and self.dtype == torch.float32
            and layer_ops.layer_ops_available()
        )
        if batch_invariant:
            self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        if not (self.fused and cpu_kernel_available()):
            raise ValueError(
                "batch-invariant mode runs the compiled CPU kernels in float32 (not "
                f"{self.device.type} {self.dtype}, cpu_kernels={self.cpu_kernels}, or the "
                "kernels did not build)"
            )
        linears = [self.lm_head, *(m for layer in self.layers for m in layer.linears())]
        dense = sum(1 for m in linears if not isinstance(m, QuantLinear))
        if dense:
            raise ValueError(
                f"batch-invariant mode needs every product on packed quantized weights "
                f"(GGUF {', '.join(t.name for t in KERNEL_TYPES)}); {dense} of "
                f"{len(linears)} are dense (load with weights='quantized')"
            )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Hugging Face normalises in float32 and casts back before the weight multiply.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run all layers over the batch; returns final hidden states of ``logits_indices``.

        ``on_layer_kv(i)`` is called as soon as layer ``i``'s keys and values are in the
        pool, before the layer's attention and MLP run: a prefill worker starts moving that
        layer's KV to the decode worker while the rest of the model computes.

        ``batch`` is checked (``ValueError`` on an index outside the RoPE tables or the pool)
        and uploaded to the model's device once; the kernels below trust it.
        """
        check_ranges(batch, self.rope.cos.shape[0], kv.keys(0).shape[:2])
        if self.fused:
            return self._forward_fused(batch, kv, on_layer_kv)
        batch = batch.to(self.device)
        cfg = self.config
        x = self._embed(batch.input_ids)
        cos, sin = self.rope.tables(batch.positions)
        q_size, kv_size, hd = cfg.q_size, cfg.kv_size, cfg.head_dim
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            qkv = layer.qkv(h)
            q = qkv[:, :q_size].view(-1, cfg.num_heads, hd)
            k = qkv[:, q_size : q_size + kv_size].view(-1, cfg.num_kv_heads, hd)
            v = qkv[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, hd)
            q = self.rope.apply(q, cos, sin)
            k = self.rope.apply(k, cos, sin)
            k_pool, v_pool = kv.keys(i), kv.values(i)
            if self.triton is not None:
                self.triton.store_kv(
                    k_pool, v_pool, k, v, batch.slot_blocks, batch.slot_offsets,
                    ranges_checked=True,
                )  # fmt: skip
            else:
                write_kv(k_pool, v_pool, k, v, batch.slot_blocks, batch.slot_offsets)
            if on_layer_kv is not None:
                on_layer_kv(i)
            attn = self._attention(q, k, v, k_pool, v_pool, batch, ranges_checked=True)
            x = x + layer.o(attn)
            h = self._rms_norm(x, layer.mlp_norm)
            gu = layer.gate_up(h)
            gate, up = gu.chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = x.index_select(0, batch.logits_indices)
        return self._rms_norm(x, self.norm)

    def _forward_fused(
        self, batch: ForwardBatch, kv: KVCache, on_layer_kv: Callable[[int], None] | None
    ) -> torch.Tensor:
        """``forward`` with the fused layer ops (CPU): the same computation, the residual
        stream ``x`` updated in place. ``forward`` checked the index ranges."""
        cfg = self.config
        q_size, kv_size, hd, eps = cfg.q_size, cfg.kv_size, cfg.head_dim, self.eps
        rope = self.rope
        rows = batch.as_decode_rows() if self.batch_invariant else None
        x = self._embed(batch.input_ids).contiguous()
        h = layer_ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            k_pool, v_pool = kv.keys(i), kv.values(i)
            layer_ops.rope_write_kv(
                qkv, rope.cos, rope.sin, batch.positions, k_pool, v_pool, batch.slot_blocks,
                batch.slot_offsets, cfg.num_heads, cfg.num_kv_heads, ranges_checked=True,
            )  # fmt: skip
            if on_layer_kv is not None:
                on_layer_kv(i)
            q = qkv[:, :q_size].view(-1, cfg.num_heads, hd)
            k = qkv[:, q_size : q_size + kv_size].view(-1, cfg.num_kv_heads, hd)
            v = qkv[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, hd)
            attn = self._attention(q, k, v, k_pool, v_pool, batch, rows, ranges_checked=True)
            h = layer_ops.add_rms_norm(x, layer.o(attn), layer.mlp_norm, eps)
            down = layer.down(layer_ops.silu_mul(layer.gate_up(h)))
            last = i + 1 == len(self.layers)
            h = layer_ops.add_rms_norm(
                x, down, self.norm if last else self.layers[i + 1].attn_norm, eps
            )
        return h.index_select(0, batch.logits_indices)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return dequantize_rows(self.embed, ids)
        return F.embedding(ids, self.embed)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this model holds: packed blocks at their size, dense ones at
        their dtype."""
        embed = self.embed
        embed_bytes = embed.nbytes if isinstance(embed, QuantizedWeight) else _tensor_bytes(embed)
        head_shared = self.config.tie_word_embeddings and isinstance(embed, QuantizedWeight)
        head_bytes = 0 if head_shared else self.lm_head.nbytes
        layers = sum(layer.nbytes for layer in self.layers)
        return embed_bytes + head_bytes + layers + _tensor_bytes(self.norm)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: ForwardBatch,
        rows: DecodeBatch | None = None,
        *,
        ranges_checked: bool = False,
    ) -> torch.Tensor:
        """Attention of every row of ``batch``. ``rows``: the batch as decode rows
        (batch-invariant mode), each row one query of the paged decode kernel."""
        if rows is not None:
            out = decode_attention(
                q, k_pool, v_pool, rows, self.scale, ranges_checked=ranges_checked
            )
            return out.reshape(out.shape[0], -1)
        outs: list[torch.Tensor] = []
        for seg in batch.prefills:
            sl = slice(seg.start, seg.start + seg.length)
            outs.append(prefill_attention(q[sl], k[sl], v[sl], k_pool, v_pool, seg, self.scale))
        if batch.decode is not None and self.triton is not None:
            d = batch.decode
            attn = self.triton.paged_decode_attention(
                q[d.start :], k_pool, v_pool, d.block_tables, d.context_lens, self.scale,
                ranges_checked=True,
            )  # fmt: skip
            outs.append(attn)
        elif batch.decode is not None:
            d = batch.decode
            outs.append(
                decode_attention(
                    q[d.start :],
                    k_pool,
                    v_pool,
                    d,
                    self.scale,
                    self.workspace,
                    kernel=self.cpu_kernels,
                    ranges_checked=ranges_checked,
                )
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[S, vocab]`` for final hidden states ``[S, hidden]``."""
        return self.lm_head(hidden).float()
