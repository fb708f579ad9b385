"""Layer-wise overlap in serving: how much of a prompt's KV is already at the decode worker
when the prefill's forward pass ends, per transport, from real requests.

One prefill worker and one decode worker per transport (``--transports``, default shm, tcp
and mooncake) run as processes on this host, one engine thread each. Every prompt length is
sent ``--requests`` times through each decode worker (``DecodeWorker.Generate`` naming the
prefill worker, one token out, one request at a time, random token ids so no prefix is
cached anywhere). The prefill worker's ``pdserve:kv_transfer_overlap_ratio`` histogram, per
transport, is read before and after each batch: the mean share is the sum's growth over the
count's. TTFT at the client is reported beside it. Target (the Mooncake paper's claim):
more than 80% of the KV is at the decode worker when the last layer is computed.

``python -m bench.overlap --help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import grpc

from bench.chaos.probes import samples, scrape
from bench.transfer import Service
from services.launcher import free_port

OVERLAP = "pdserve:kv_transfer_overlap_ratio"
START_S = 180.0
TARGET = 0.8


@dataclass(frozen=True)
class Row:
    """One transport at one prompt length."""

    transport: str
    tokens: int
    requests: int
    mean_share: float
    ttft_p50_s: float


def share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The mean of the observations between two (sum, count) readings of a histogram.

    >>> share((1.5, 2.0), (3.0, 4.0))
    0.75
    """
    count = after[1] - before[1]
    if count <= 0:
        raise ValueError("no observation between the two readings")
    return (after[0] - before[0]) / count


def table(rows: Sequence[Row]) -> str:
    """The results as a Markdown table, the target's verdict in the last column."""
    lines = [
        "| transport | prompt tokens | requests | KV at decode when prefill ends | TTFT P50 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = "pass" if r.mean_share > TARGET else "FAIL"
        lines.append(
            f"| {r.transport} | {r.tokens} | {r.requests} | {r.mean_share:.0%} {verdict} "
            f"| {r.ttft_p50_s * 1000:.0f} ms |"
        )
    return "\n".join(lines)


async def _reading(session: aiohttp.ClientSession, url: str, transport: str) -> tuple[float, float]:
    text = await scrape(session, url)
    want = {"transport": transport}

    def value(name: str) -> float:
        found = [v for labels, v in samples(text, name) if want.items() <= labels.items()]
        return found[0] if found else 0.0

    return value(f"{OVERLAP}_sum"), value(f"{OVERLAP}_count")


async def _ttft(address: str, prefill: str, rid: str, ids: list[int]) -> float:
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    request = worker_pb2.DecodeGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        prefill_address=prefill,
    )
    async with grpc.aio.insecure_channel(address) as ch:
        started = time.monotonic()
        async for _ in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(request, timeout=120):
            return time.monotonic() - started
    raise RuntimeError(f"{rid}: the stream ended without a token")


async def measure(
    decodes: dict[str, str], prefill: str, metrics_url: str, lengths: Sequence[int], n: int
) -> list[Row]:
    rng = random.Random(0)
    rows = []
    async with aiohttp.ClientSession() as session:
        for tokens in lengths:
            for transport, address in decodes.items():
                before = await _reading(session, metrics_url, transport)
                ttfts = []
                for i in range(n):
                    ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
                    rid = f"overlap-{transport}-{tokens}-{i}"
                    ttfts.append(await _ttft(address, prefill, rid, ids))
                after = await _reading(session, metrics_url, transport)
                rows.append(
                    Row(transport, tokens, n, share(before, after), statistics.median(ttfts))
                )
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.overlap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--transports", default="shm,tcp,mooncake", help="(default: %(default)s)")
    p.add_argument(
        "--lengths", default="512,1024,2048", help="prompt tokens (default: %(default)s)"
    )
    p.add_argument("--requests", type=int, default=3, help="per length and transport")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="each worker's KV pool")
    args = p.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    engine = ["--threads", "1", "--kv-cache-mib", str(args.kv_cache_mib), "--port", "0"]
    metrics_port = free_port()
    services = [
        Service(
            [
                "-m",
                "services.prefill",
                *engine,
                "--metrics-port",
                str(metrics_port),
                "--transports",
                ",".join(sorted({"shm", *transports})),
            ]
        )
    ]
    for t in transports:
        flags = ["--mooncake-protocol", "tcp"] if t == "mooncake" else []
        services.append(Service(["-m", "services.decode", *engine, "--transport", t, *flags]))
    try:
        prefill = services[0].wait_for("READY ", START_S).split()[2]
        decodes = {t: s.wait_for("READY ", START_S).split()[2] for t, s in zip(
            transports, services[1:], strict=True
        )}  # fmt: skip
        rows = asyncio.run(
            measure(
                decodes, prefill, f"http://127.0.0.1:{metrics_port}/metrics", lengths,
                args.requests,
            )
        )  # fmt: skip
    finally:
        for s in services:
            s.stop()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
