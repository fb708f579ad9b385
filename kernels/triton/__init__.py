"""Triton kernels for paged attention and KV movement on GPUs.

One module per kernel, each with its ``@triton.jit`` kernel, a torch reference and a
checking launcher: ``decode_attention`` (paged decode attention, GQA), ``kv_store`` (a
step's K/V into its slots), ``kv_blocks`` (one layer's blocks of a request packed into a
contiguous buffer for transfer, and back). Prefill over a cached prefix has no Triton
kernel: see ``docs/gpu.md`` for why torch SDPA over the gathered context is used instead.

Only tests import this package (on CPU through ``TRITON_INTERPRET=1``); the CPU engine never
does, so triton stays a test dependency. Import the modules by their absolute names
(``kernels.triton.decode_attention``): inside them ``import triton`` is the real package.
"""
