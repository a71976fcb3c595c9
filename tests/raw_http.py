"""HTTP/1.1 on plain sockets, for tests that decide byte by byte what a client sends,
when it reads and when it hangs up, which no HTTP client library lets them do."""

import socket
import time

from tests.live_server import LiveServer

# A request head that is never finished: slowloris sends one of these, then a byte now
# and then.
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def port_of(live: LiveServer) -> int:
    return int(live.base_url.rsplit(":", 1)[1])


def connect(live: LiveServer, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # a small receive window: the server's writes stall once it is full
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port_of(live)))
    return sock


def post_json(path: str, payload: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes | None:
    """Everything the server sent until it closed, or None if it kept the connection."""
    data, deadline = b"", time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        return data
    return None


def trickle_until_closed(sock: socket.socket, patience_s: float) -> bytes | None:
    """Sends a header byte every 0.2 s, as slowloris does to defeat idle timeouts, until
    the server answers or closes (then: what it sent) or `patience_s` passed (None)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"a")
            sock.settimeout(0.2)
            sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            continue
        except OSError:
            pass
        return read_until_closed(sock, 10)
    return None
