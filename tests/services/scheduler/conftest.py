"""One real redis-server for the scheduler tests; each test uses its own key prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.redis_server import RedisServer, redis_server_fixture

redis_server = redis_server_fixture(scope="session")


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sync_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()
