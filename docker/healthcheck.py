"""The image's HEALTHCHECK: GET /health on the control API egressd was configured with.

Reads the same settings as ``egressd serve`` (EGRESSD_* variables, then the
file in EGRESSD_CONFIG), so it asks wherever the control API really listens:
a TCP address (an unspecified host means this container's loopback) or a
unix socket. Exit 0 when /health answers 200, 1 otherwise (Docker's contract).
"""

from __future__ import annotations

import http.client
import socket
import sys

from egressd.config.settings import SettingsError, load_settings, parse_hostport

TIMEOUT_S = 2.0  # well inside the HEALTHCHECK --timeout of 3 s


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        sock.connect(self._path)
        self.sock = sock


def main() -> int:
    try:
        control = load_settings({}).control
    except SettingsError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    if control.startswith("unix:"):
        conn: http.client.HTTPConnection = _UnixConnection(control.removeprefix("unix:"))
    else:
        host, port = parse_hostport(control, "control")
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
    except OSError as exc:
        print(f"healthcheck: {control}: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
