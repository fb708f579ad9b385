"""``python -m services.scheduler``: run the scheduler until SIGTERM or SIGINT.

Once serving it prints ``READY scheduler <host>:<grpc port>`` on stdout (logs go to stderr).
On SIGTERM the health service turns NOT_SERVING first, new placements are refused, RPCs in
flight get ``--drain-timeout-s`` seconds to finish, queued Redis writes are flushed, and
the process exits 0. Its settings: ``services.scheduler.config``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.common import process
from services.scheduler.config import SchedulerConfig, load_config


async def _main(config: SchedulerConfig) -> int | None:
    import structlog

    from services.scheduler.server import SchedulerServer

    try:
        server = SchedulerServer(config)
    except ValueError as e:  # a key or password file that cannot be used
        structlog.get_logger(__name__).error("scheduler_unusable_config", error=str(e))
        return 2
    await server.start()
    try:
        await process.serve(
            server.grpc,
            role="scheduler",
            drain_timeout_s=config.drain_timeout_s,
            on_drain=server.drain,
        )
    finally:
        await server.close()


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(argv)
    return process.run(
        "scheduler",
        config.log_level,
        _main(config),
        cluster=config.cluster,
        faults=config.fault_args,
    )


if __name__ == "__main__":
    sys.exit(main())
