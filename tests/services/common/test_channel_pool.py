"""services.common.channel_pool: channels to peers that come and go are reused while in use
and closed once idle, so a gateway or decode worker that saw many workers restart on new
ports does not keep a channel to each of them forever."""

from __future__ import annotations

import asyncio

from services.common.channel_pool import ChannelPool


class _Channel:
    """Stands in for a grpc.aio.Channel: the pool only opens and closes channels."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_idle_channels_are_closed_and_held_ones_never() -> None:
    now = [0.0]
    opened: list[_Channel] = []

    def open_channel(address: str) -> _Channel:
        opened.append(_Channel(address))
        return opened[-1]

    pool = ChannelPool(open_channel, idle_s=60, max_idle=2, clock=lambda: now[0])  # type: ignore[arg-type]
    held = pool.acquire("decode-a:1")
    async with pool.lease("decode-a:1") as again:
        assert again is held  # one channel per address, reused
    for port in range(2, 7):  # workers restarting on new ports, one request each
        async with pool.lease(f"decode-b:{port}"):
            now[0] += 1
    await asyncio.sleep(0)  # the closes run on the loop
    # the held one stays, and only the newest two idle ones
    assert len(pool) == 3 and not held.closed
    assert [c.closed for c in opened[1:]] == [True, True, True, False, False]
    now[0] += 61  # past idle_s: every idle channel goes at the next release
    pool.release("decode-a:1")
    await asyncio.sleep(0)
    assert len(pool) == 0 and all(c.closed for c in opened)
    await pool.close()
