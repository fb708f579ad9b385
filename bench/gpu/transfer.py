"""KV transfer from a GPU engine's pool, per transport: the path a prefill worker on a GPU
takes, without the model.

    python -m bench.gpu.transfer --json gpu-transfer.json          # cuda, bf16
    python -m bench.gpu.transfer --device cpu --tokens 64 --repeats 2 --transports shm tcp

One request's KV in the default model's layout (30 layers, 3 KV heads, head dim 64,
16-token blocks), in the device pool of this process. A spawned peer process registers one
region per transport, as a decode worker does. Per transport, each repeat is one job:
``begin``, then for every layer the prefill worker's hook (``shm``/``tcp``: the layer staged
to the pinned host pool on a side stream, ``engine/kv_staging.py``; ``cuda_ipc``: an event
after the layer, the writer copying GPU to GPU), then ``finish``, timed from ``begin`` to the
outcome in hand. GB/s is the request's KV bytes over that time (median). Every transport's
bytes are checked in the peer afterwards. On the CPU (``--device cpu``) the staging runs
between two CPU pools and ``cuda_ipc`` is not offered: the command works, its figures mean
little.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench._common import median, write_json

LAYOUT = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
SEED = 5


def _pattern(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


def _peer(conn: Connection, transports: list[str], layout: dict[str, Any], device: str) -> None:
    """The decode side: one region per transport; answers ``check`` with bytes that differ."""
    from transfer import KVLayout, get_transport

    kv_layout = KVLayout.from_dict(layout)
    opened = []
    regions = {}
    for name in transports:
        opts = {"device": device} if name == "cuda_ipc" else {}
        transport = get_transport(name, **opts)
        opened.append(transport)
        regions[name] = transport.register(kv_layout)
    conn.send({name: region.handle.to_dict() for name, region in regions.items()})
    while True:
        message = conn.recv()
        if message[0] == "check":
            _, name, dst_ids, src_bytes = message
            want = _pattern(src_bytes).view(kv_layout.num_layers, 2, -1)
            got = regions[name].tensor.cpu().view(kv_layout.num_layers, 2, -1)
            bb = kv_layout.block_bytes
            # the source blocks are 0..n-1, laid into dst_ids
            wrong = sum(
                int((got[:, :, d * bb : (d + 1) * bb] != want[:, :, s * bb : (s + 1) * bb]).sum())
                for s, d in enumerate(dst_ids)
            )
            conn.send(wrong)
        else:
            for transport in opened:
                transport.close()
            conn.send("closed")
            return


def run(args: argparse.Namespace) -> dict[str, object]:
    from engine.kv_cache import KVCache
    from engine.kv_staging import KVStaging, after_enqueued
    from transfer import KVLayout, KVSource, MemoryRegionHandle, get_transport

    device = torch.device(args.device)
    max_tokens = max(args.tokens)
    blocks = -(-max_tokens // LAYOUT["block_size"])
    src_layout = KVLayout(num_blocks=blocks, dtype=args.dtype, **LAYOUT)
    dst_layout = KVLayout(num_blocks=2 * blocks + 1, dtype=args.dtype, **LAYOUT)
    spec = src_layout.to_spec()
    pool = KVCache(spec, device=device)
    pool.as_bytes().copy_(_pattern(spec.total_bytes, device))
    pinned = device.type == "cuda"
    host = KVCache(spec, torch.zeros(spec.total_bytes, dtype=torch.uint8, pin_memory=pinned))
    staging = KVStaging(pool, host)
    sources = {False: KVSource(host.as_bytes(), src_layout)}
    if device.type == "cuda":
        sources[True] = KVSource(pool.as_bytes(), src_layout)

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, args.transports, dst_layout.to_dict(),
                                           str(device)), daemon=True)  # fmt: skip
    peer.start()
    child.close()
    if not conn.poll(120):
        raise RuntimeError("the peer process did not register its regions")
    handles = {n: MemoryRegionHandle.from_dict(h) for n, h in conn.recv().items()}
    rows = []
    try:
        for name in args.transports:
            transport = get_transport(
                name, **({"device": str(device)} if name == "cuda_ipc" else {})
            )
            on_device = transport.source_on_device
            writer = transport.connect(handles[name], sources[on_device])
            for tokens in args.tokens:
                n = -(-tokens // LAYOUT["block_size"])
                src_ids = list(range(n))
                # scattered destination runs, as in a fragmented decode pool
                dst_ids = [2 * i + i % 2 for i in range(n)]
                times = []
                for repeat in range(args.repeats + 1):  # the first is the warm-up
                    start = time.perf_counter()
                    job = writer.begin(f"{name}-{tokens}-{repeat}", src_ids, dst_ids,
                                       deadline=time.monotonic() + 60)  # fmt: skip
                    for layer in range(src_layout.num_layers):
                        if on_device:
                            ready = after_enqueued(device)
                        else:
                            ready = staging.stage_layer(layer, src_ids)
                        job.write_layer(layer, ready)
                    result = job.finish().result(120)
                    times.append(time.perf_counter() - start)
                conn.send(("check", name, dst_ids, src_layout.total_bytes))
                wrong = conn.recv()
                if wrong:
                    raise RuntimeError(f"{name}: {wrong} bytes differ at the destination")
                seconds = median(times[1:])
                rows.append({"transport": name, "tokens": tokens, "bytes": result.bytes,
                             "ms": seconds * 1e3, "gbs": result.bytes / seconds / 1e9})  # fmt: skip
            transport.close()
    finally:
        conn.send(("close",))
        conn.recv()
        peer.join(10)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "layout": LAYOUT,
        "transfers": rows,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--transports", nargs="+", default=None,
                   help="default: shm tcp, and cuda_ipc on cuda")  # fmt: skip
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.transports is None:
        args.transports = ["shm", "tcp"] + (["cuda_ipc"] if args.device.startswith("cuda") else [])
    if min(args.tokens) < 1 or args.repeats < 1:
        print("tokens and repeats must be >= 1", file=sys.stderr)
        return 2
    if "cuda_ipc" in args.transports and not args.device.startswith("cuda"):
        print("cuda_ipc moves GPU memory: it needs --device cuda", file=sys.stderr)
        return 2
    result = run(args)
    for row in result["transfers"]:  # type: ignore[attr-defined]
        print(f"{row['transport']:>8} {row['tokens']:>6} tokens: {row['ms']:8.2f} ms "
              f"{row['gbs']:6.2f} GB/s")  # fmt: skip
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
