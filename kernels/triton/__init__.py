"""Triton kernels for paged attention and the KV store on GPUs.

One module per kernel, each with its ``@triton.jit`` kernel and a checking launcher, checked
against its torch reference in ``kernels/reference.py``: ``decode_attention`` (paged decode
attention, GQA) and ``kv_store`` (a step's K/V into its slots). The engine runs both on
``--device cuda`` (``engine/model.py``); prefill over a cached prefix has no Triton kernel:
see ``docs/gpu.md`` for why torch SDPA over the gathered context is used instead.

Only an engine that runs these kernels imports this package (and the tests, on CPU through
``TRITON_INTERPRET=1``); the CPU engine never does, so triton is not a dependency of the CPU
engine. Import the modules by their absolute names (``kernels.triton.decode_attention``):
inside them ``import triton`` is the real package.
"""
