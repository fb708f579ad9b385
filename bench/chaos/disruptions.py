"""When the chaos run kills what: a pure plan of ``kill -9``s, each due once a given number
of requests has finished (completed, failed or hung)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kill:
    """``kill -9`` of process ``target`` once ``after`` requests have finished."""

    target: str
    after: int


def plan(
    requests: int,
    *,
    kill_prefill: bool,
    kill_decode: bool,
    restart_redis: bool,
    restart_kv_store: bool = False,
) -> tuple[Kill, ...]:
    """One prefill worker after a third of the requests, the shm decode worker (whose
    segment a SIGKILL leaves behind) after a half, Redis after two thirds, the KV store's
    master (every stored block forgotten) after five sixths.

    >>> plan(300, kill_prefill=True, kill_decode=True, restart_redis=True)
    (Kill(target='prefill-0', after=100), Kill(target='decode-0', after=150), \
Kill(target='redis', after=200))
    >>> plan(300, kill_prefill=False, kill_decode=False, restart_redis=False,
    ...      restart_kv_store=True)
    (Kill(target='kv-store', after=250),)
    """
    kills = []
    if kill_prefill:
        kills.append(Kill("prefill-0", max(1, requests // 3)))
    if kill_decode:
        kills.append(Kill("decode-0", max(1, requests // 2)))
    if restart_redis:
        kills.append(Kill("redis", max(1, 2 * requests // 3)))
    if restart_kv_store:
        kills.append(Kill("kv-store", max(1, 5 * requests // 6)))
    return tuple(sorted(kills, key=lambda k: k.after))
