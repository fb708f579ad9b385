"""The GPU check's measurements, run by ``bash scripts/gpu_check.sh`` (docs/gpu.md), the one
GPU entry point: ``kernels`` (Triton decode attention against the device's copy bandwidth),
``transfer`` (one request's KV from a GPU pool per transport), ``engine`` (step times on the
device) and ``report`` (their JSON files as one table). The product never imports them."""
