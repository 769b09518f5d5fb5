"""TCP ports on this host: the one place that binds to ask whether a port is free.

Every question about a port is a ``bind`` on this host, with the options a server sets when it
listens (``SO_REUSEADDR``, as uvicorn and vLLM do): a port answers "free" exactly when such a server
could listen on it now. A port whose last connections linger in TIME_WAIT is free to them, and so
here; a port another process listens on (on this address or on every address) is not.

No answer outlives the call: between ``port_free``/``free_port`` and the server's own bind, another
process may take the port. A server in this process avoids the race by keeping the socket ``bind``
returns and listening on it (``nectar serve``'s torch engine); a server in a child process (vLLM)
binds the port itself, and a lost race shows as that server failing to start, with its log.
"""
from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), for a server to listen on; OSError when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_free(host: str, port: int) -> bool:
    """Could a server listen on ``host:port`` now?"""
    try:
        bind(host, port).close()
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now (the system's choice)."""
    with bind(host, 0) as sock:
        return sock.getsockname()[1]
