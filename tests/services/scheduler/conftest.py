"""One real redis-server for the scheduler tests; each test uses its own key prefix."""

from __future__ import annotations

from tests.redis_server import redis_server_fixture

redis_server = redis_server_fixture(scope="session")
