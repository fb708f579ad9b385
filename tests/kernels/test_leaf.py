"""``kernels/`` is a leaf: the engine imports the kernels and their torch references, never
the reverse (a kernel takes plain tensors and ints, not the engine's batch types)."""

from __future__ import annotations

from scripts.house_stats import imports_between


def test_kernels_import_nothing_from_the_engine() -> None:
    assert imports_between("kernels", "engine") == []


def test_the_check_sees_an_import_where_there_is_one() -> None:
    assert "engine/model.py -> kernels.reference" in imports_between("engine", "kernels")
