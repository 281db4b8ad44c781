"""Which API keys a server accepts (``--api-keys-file``, ``$DEEPSPEED_TINKER_API_KEYS``), and where a server without
keys may listen; in-process and through the command line (no ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tinker_sdk_helpers import require

require("fastapi")
from http_in_process import client  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.http_app import HttpSettings  # noqa: E402
from deepspeed_tinker.keys import KEYS_ENV, check_host, load_api_keys, startup_line  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


def test_keys_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team A\ntml-a\n\n  tml-b  \n")
    assert load_api_keys(keys_file, {}) == {"tml-a", "tml-b"}
    assert load_api_keys(keys_file, {KEYS_ENV: "tml-c, tml-d tml-a"}) == {"tml-a", "tml-b", "tml-c", "tml-d"}
    assert load_api_keys(None, {KEYS_ENV: "tml-c"}) == {"tml-c"}
    assert load_api_keys(None, {}) == frozenset()


@pytest.mark.parametrize("content, env, message", [
    ("# nothing\n\n", {}, "names no key"),
    ("sk-secret\n", {}, "without the 'tml-' prefix"),
    (None, {KEYS_ENV: "tml-a,sk-b"}, KEYS_ENV),
])
def test_bad_keys_are_refused_naming_their_source(tmp_path: Path, content: str | None, env: dict,
                                                  message: str) -> None:
    keys_file = None
    if content is not None:
        keys_file = tmp_path / "keys"
        keys_file.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_api_keys(keys_file, env)
    assert "secret" not in str(error.value), "a key is never echoed"
    with pytest.raises(ValueError, match="--api-keys-file"):
        load_api_keys(tmp_path / "missing", {})


def test_without_keys_only_loopback() -> None:
    check_host("127.0.0.1", frozenset())
    check_host("::1", frozenset())
    check_host("0.0.0.0", frozenset({"tml-a"}))
    with pytest.raises(ValueError, match="--api-keys-file"):
        check_host("0.0.0.0", frozenset())
    assert "loopback only" in startup_line("127.0.0.1", frozenset())
    assert "any other key gets 401" in startup_line("0.0.0.0", frozenset({"tml-a"}))


def test_only_the_given_keys_are_accepted(tmp_path: Path) -> None:
    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, long_poll_s=0.05))
    http = client(api, HttpSettings(api_keys=frozenset({"tml-team-a", "tml-team-b"})))
    for key in ("tml-team-a", "tml-team-b"):
        assert http.get("/api/v1/healthz", headers={"X-API-Key": key}).status_code == 200
    for headers in ({"X-API-Key": "tml-team-c"}, {"X-API-Key": "tml-team-a "}, {}):
        response = http.post("/api/v1/create_session", headers=headers, content=b"{}")
        assert response.status_code == 401 and response.json()["category"] == "user", headers
    # Without keys: any key with the SDK's prefix (a local development server).
    open_http = client(api, HttpSettings())
    assert open_http.get("/api/v1/healthz", headers={"X-API-Key": "tml-anything"}).status_code == 200
    assert open_http.get("/api/v1/healthz", headers={"X-API-Key": "sk-1"}).status_code == 401


def test_serve_refuses_a_public_host_without_keys(tmp_path: Path) -> None:
    """Refused at the command line, before any rank starts; no key is ever an option's value."""
    run = subprocess.run([sys.executable, "-m", "deepspeed_tinker", "serve", "--host", "0.0.0.0", "--port", "0",
                          "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and "--api-keys-file" in run.stderr and KEYS_ENV in run.stderr, run.stderr
    help_text = subprocess.run([sys.executable, "-m", "deepspeed_tinker", "serve", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    assert "--api-keys-file" in help_text and "--api-key " not in help_text
