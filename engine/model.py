"""Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights arrive with Hugging Face names (``engine/checkpoint.py``) and are fused here:
q/k/v into one projection and gate/up into another, so a layer is four matrix products,
each a ``kernels.linear.PackedLinear`` (weights pre-packed for oneDNN on float32 CPU).
The forward pass takes a flat ``ForwardBatch`` (all sequences' new tokens concatenated)
and reads/writes keys and values in the paged pool (``engine/kv_cache.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import Workspace, decode_attention, prefill_attention, write_kv
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.rope import RotaryEmbedding
from kernels.linear import PackedLinear


class _Layer:
    __slots__ = ("attn_norm", "down", "gate_up", "mlp_norm", "o", "qkv")

    def __init__(self, t: dict[str, torch.Tensor], i: int, pack: bool | None) -> None:
        p = f"model.layers.{i}."
        self.attn_norm = t[p + "input_layernorm.weight"]
        self.mlp_norm = t[p + "post_attention_layernorm.weight"]
        self.qkv = PackedLinear(
            torch.cat([t[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")], dim=0),
            pack=pack,
        )
        self.o = PackedLinear(t[p + "self_attn.o_proj.weight"], pack=pack)
        self.gate_up = PackedLinear(
            torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]], dim=0),
            pack=pack,
        )
        self.down = PackedLinear(t[p + "mlp.down_proj.weight"], pack=pack)


class LlamaModel:
    """Inference-only Llama decoder. Not thread-safe: one engine loop drives it.

    ``cpu_kernels=False`` keeps to the torch reference: plain ``F.linear`` and the gathered
    attention, never the packed oneDNN weights or the C++ attention kernel."""

    def __init__(
        self, config: ModelConfig, tensors: dict[str, torch.Tensor], *, cpu_kernels: bool = True
    ) -> None:
        self.config = config
        self.cpu_kernels = cpu_kernels
        pack = None if cpu_kernels else False  # None: PackedLinear packs where it can
        self.dtype = tensors["model.embed_tokens.weight"].dtype
        self.embed = tensors["model.embed_tokens.weight"]
        self.norm = tensors["model.norm.weight"]
        # Tied heads keep the dense embedding for lookups; the head gets its own packed copy.
        self.lm_head = PackedLinear(
            self.embed if config.tie_word_embeddings else tensors["lm_head.weight"], pack=pack
        )
        self.layers = [_Layer(tensors, i, pack) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config, self.dtype)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.eps = config.rms_norm_eps
        self.workspace = Workspace()

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
        """
        cfg = self.config
        x = F.embedding(batch.input_ids, self.embed)
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
            write_kv(k_pool, v_pool, k, v, batch.slot_blocks, batch.slot_offsets)
            if on_layer_kv is not None:
                on_layer_kv(i)
            attn = self._attention(q, k, v, k_pool, v_pool, batch)
            x = x + layer.o(attn)
            h = self._rms_norm(x, layer.mlp_norm)
            gu = layer.gate_up(h)
            gate, up = gu.chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = x.index_select(0, batch.logits_indices)
        return self._rms_norm(x, self.norm)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for seg in batch.prefills:
            sl = slice(seg.start, seg.start + seg.length)
            outs.append(prefill_attention(q[sl], k[sl], v[sl], k_pool, v_pool, seg, self.scale))
        if batch.decode is not None:
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
                )
            )
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[S, vocab]`` for final hidden states ``[S, hidden]``."""
        return self.lm_head(hidden).float()
