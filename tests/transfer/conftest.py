"""Every test here runs with the writers' owner-thread checks on (``check_owners``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from transfer.writer import check_owners


@pytest.fixture(autouse=True, scope="session")
def _owner_checks() -> Iterator[None]:
    check_owners()
    yield
    check_owners(False)
