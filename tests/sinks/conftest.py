"""A real Alertmanager (and the webhook it notifies) per test that asks for one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alertmanager_proc import Alertmanager, WebhookReceiver, require_alertmanager


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.fixture
def alertmanager(tmp_path, webhook) -> Iterator[Alertmanager]:
    require_alertmanager()
    manager = Alertmanager(tmp_path, webhook.url)
    try:
        manager.wait_ready()
        yield manager
    finally:
        manager.stop()
