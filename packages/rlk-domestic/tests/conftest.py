"""The domestic backend's tests run it on the CPU through its stand-in (``RLK_DOMESTIC_STANDIN=cpu``), switched on
per test and off again after it, so no other test sees the backend available."""

from __future__ import annotations

import pytest

from rlk.core import dispatch
from rlk_domestic import ENV_STANDIN


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv(ENV_STANDIN, "cpu")
    dispatch.refresh()
    yield
    monkeypatch.delenv(ENV_STANDIN)
    dispatch.refresh()
