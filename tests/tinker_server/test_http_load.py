"""Results are freed once read, so the store's bound limits what is held, not the request rate: a steady load of
cheap requests, each result retrieved, is served without a 429 for many times the store's size."""

from __future__ import annotations

from typing import Iterator

import pytest
from http_load import run_load
from tinker_sdk_helpers import require, served

pytestmark = pytest.mark.pr("zero-0-1")
MAX_FUTURES = 2000
GRACE_S = 1.0
RATE = 280.0
SECONDS = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    require("tinker")
    # Results unread would be kept an hour: at most 2000 / 3600 s = 0.6 requests a second if results were held
    # for their TTL, as they were before; freed a second after they are read, 2000 a second
    options = ("--max-futures", str(MAX_FUTURES), "--future-ttl-s", "3600", "--retrieved-grace-s", str(GRACE_S))
    with served(tmp_path_factory.mktemp("tinker-load"), 1, extra_args=options) as server:
        yield server


def test_a_load_of_read_results_far_past_the_store_size_gets_no_429(server) -> None:
    result = run_load(server.base_url, RATE, SECONDS, sessions=4)
    assert result.sent > MAX_FUTURES, f"the load must pass the store's size to test anything: {result}"
    assert result.statuses == {200: result.sent}, result
