"""A real S3 endpoint on loopback for the object-store tests: moto's server in a process.

Not a mock of the client: s3fs (aiobotocore) speaks HTTP to ``moto.server``, which implements
S3's API (multi-part uploads included) in memory. The endpoint and credentials go into the
environment the way a user's would (``AWS_ENDPOINT_URL``, the ``AWS_*`` keys), so ranks and
jobs started from a test find it with no storage_options.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class S3Endpoint:
    url: str  # http://127.0.0.1:<port>

    def env(self) -> dict[str, str]:
        """The variables a process needs to reach this endpoint as the AWS default."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self):
        """An s3fs client of this endpoint (a fresh one: no listing cached by another)."""
        import s3fs

        return s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            endpoint_url=self.url,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def new_bucket(self) -> str:
        """A new, empty bucket's URL (``s3://<name>``)."""
        name = f"distkit-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return f"s3://{name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[S3Endpoint]:
    """moto's S3 server on a free loopback port, for the block's length."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    pytest.importorskip("s3fs", reason="s3fs is in the test extra")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's server did not start on port {port}")
            time.sleep(0.1)
        yield S3Endpoint(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


def point_environment_at(endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process (and what it starts) reaches ``endpoint`` as its S3."""
    for key, value in endpoint.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
