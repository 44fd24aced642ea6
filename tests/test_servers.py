"""Server helpers: a health check sees the environment as it is now, not as it once was."""

from __future__ import annotations

import http.server
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from tasks.shared.servers import healthy


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
