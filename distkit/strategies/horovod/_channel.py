"""The side channel under horovodrun: its rendezvous server's HTTP key-value store.

``horovodrun --gloo`` (the only way Horovod runs here) starts an HTTP key-value server and
tells every worker where it is (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``). Under mpirun
there is no such server, and Horovod jobs then have no failure notices or hang reports beyond
what the launcher does.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

REQUEST_TIMEOUT_S = 5.0


class HorovodKVChannel:
    """:class:`~distkit.faults._channel.SideChannel` over horovodrun's rendezvous key-value server.

    ``set_first`` reads, then writes: two ranks failing within the same few milliseconds may
    both see their notice as the first (then both print one line).
    """

    def __init__(self, addr: str, port: int, scope: str) -> None:
        self._base = f"http://{addr}:{port}/{urllib.parse.quote(scope, safe='')}/"

    @classmethod
    def from_env(cls, scope: str, env: Mapping[str, str] | None = None) -> HorovodKVChannel | None:
        """The channel horovodrun's variables point to, or None (e.g. under mpirun)."""
        env = os.environ if env is None else env
        addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        if not addr or not port or not port.isdigit():
            return None
        return cls(addr, int(port), scope)

    def _url(self, key: str) -> str:
        return self._base + urllib.parse.quote(key, safe="")

    def set(self, key: str, value: str) -> None:
        request = urllib.request.Request(self._url(key), data=value.encode(), method="PUT")
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S):
            pass

    def get(self, key: str) -> str | None:
        try:
            with urllib.request.urlopen(self._url(key), timeout=REQUEST_TIMEOUT_S) as response:
                return bytes(response.read()).decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def set_first(self, key: str, value: str) -> str:
        current = self.get(key)
        if current is not None:
            return current
        self.set(key, value)
        return value

    def get_many(self, keys: list[str]) -> list[str | None]:
        return [self.get(key) for key in keys]
