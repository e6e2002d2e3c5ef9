"""The servers' shared fixture: `server`, a `static-decode serve` subprocess of `chat_model`
(tests/commands/conftest.py) for one test module, stopped after it. A module whose server needs other flags or
another checkpoint defines its own `server`."""

from __future__ import annotations

import pytest

from tests.support.servers import Server


@pytest.fixture(scope="module")
def server(chat_model):
    s = Server(chat_model)
    yield s
    s.stop()
