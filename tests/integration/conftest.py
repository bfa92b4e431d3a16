"""Every test here runs a real Ray cluster with real NIXL: marked ``ray`` for ``-m``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.ray)
