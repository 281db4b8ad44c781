"""The API keys a server accepts: from a file (``--api-keys-file``) and/or an environment variable, never from the
command line (where every user of the machine could read them in the process list).

With keys, any other ``X-API-Key`` gets 401. Without any, the server accepts every key with the SDK's ``tml-``
prefix, as a local development server, and so may only listen on loopback.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Mapping

#: Keys separated by commas or whitespace.
KEYS_ENV = "DEEPSPEED_TINKER_API_KEYS"
#: The prefix the tinker SDK requires of a key before it sends it.
SDK_PREFIX = "tml-"


def load_api_keys(keys_file: Path | None, environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The accepted keys: the file's (one per line; blank lines and ``#`` comments skipped) plus ``$KEYS_ENV``'s.

    Raises ValueError naming the file, or the variable, for a key the SDK could not send (no ``tml-`` prefix) and
    for a file that names no key.
    """
    keys: set[str] = set()
    if keys_file is not None:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-keys-file {keys_file}: {e.strerror or e}") from None
        from_file = {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
        if not from_file:
            raise ValueError(f"--api-keys-file {keys_file} names no key (one key per line)")
        _check_prefix(from_file, f"--api-keys-file {keys_file}")
        keys |= from_file
    from_env = set(environ.get(KEYS_ENV, "").replace(",", " ").split())
    _check_prefix(from_env, f"${KEYS_ENV}")
    return frozenset(keys | from_env)


def _check_prefix(keys: set[str], source: str) -> None:
    bad = sorted(key for key in keys if not key.startswith(SDK_PREFIX))
    if bad:
        raise ValueError(f"{source}: {len(bad)} key(s) without the {SDK_PREFIX!r} prefix the tinker SDK requires")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, keys: frozenset[str]) -> None:
    """Without keys the server only listens on loopback: refuse another ``--host`` (ValueError naming both)."""
    if not keys and not is_loopback(host):
        raise ValueError(f"--host {host} without API keys: a server without keys accepts any 'tml-' key, so it "
                         f"listens on loopback only; give the keys it should accept (--api-keys-file or "
                         f"${KEYS_ENV}), or serve on 127.0.0.1")


def startup_line(host: str, keys: frozenset[str]) -> str:
    """What the server says at start-up about who may call it."""
    if keys:
        return f"accepting {len(keys)} API key(s); any other key gets 401"
    return (f"no API keys given (--api-keys-file, ${KEYS_ENV}): accepting any 'tml-' key, listening on loopback "
            f"only ({host})")
