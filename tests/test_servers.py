"""Server helpers: a health check sees the environment as it is now, not as it once was; a long
wait polls less and less often."""

from __future__ import annotations

import http.server
import itertools
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from tasks.shared.servers import healthy, wait_until


@pytest.fixture
def health_url() -> Iterator[str]:
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/health"
    server.shutdown()
    server.server_close()


def test_a_proxy_set_once_does_not_stick_to_later_health_checks(
    health_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check while a test (or a download in a user's shell) had http_proxy at a dead port:
    # urllib's urlopen builds its one process-wide opener then, with that proxy, for good.
    # (This test's own opener goes when it ends: a broken one would fail every later check.)
    monkeypatch.setattr(urllib.request, "_opener", None)
    with monkeypatch.context() as patch:
        for var in ("http_proxy", "HTTP_PROXY"):
            patch.setenv(var, "http://127.0.0.1:9")
        for var in ("no_proxy", "NO_PROXY"):
            patch.delenv(var, raising=False)
        assert not healthy(health_url, timeout_s=2)
    assert healthy(health_url)


def test_a_wait_that_backs_off_polls_less_and_still_returns_what_was_ready() -> None:
    def counting(calls: list[float], ready_after_s: float) -> Callable[[], str | None]:
        start = time.monotonic()

        def ready() -> str | None:
            calls.append(time.monotonic() - start)
            return "ready" if calls[-1] >= ready_after_s else None

        return ready

    fixed: list[float] = []
    backing_off: list[float] = []
    assert wait_until(counting(fixed, 2.0), 10, interval_s=0.1) == "ready"
    assert wait_until(counting(backing_off, 2.0), 10, 0.1, max_interval_s=0.5) == "ready"
    assert len(fixed) >= 12  # every 0.1 s for 2 s (fewer on a busy machine)
    assert len(backing_off) <= 9  # 0.1, 0.15, 0.225, 0.34, then every 0.5 s
    pauses = [b - a for a, b in itertools.pairwise(backing_off)]
    assert max(pauses) < 0.7  # never longer than the cap (plus the scheduler's slack)
    assert wait_until(lambda: None, 0.3, interval_s=0.1, max_interval_s=0.2) is None  # timed out
