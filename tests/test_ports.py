"""nectar.ports: the one answer to "is this port free" (a bind on this host, as a server binds)."""
from __future__ import annotations

import socket

import pytest

from nectar.ports import bind, free_port, port_free


@pytest.mark.parametrize("listen_on", ["127.0.0.1", "0.0.0.0"])
def test_a_port_someone_listens_on_is_not_free_until_they_stop(listen_on):
    with socket.socket() as other:
        other.bind((listen_on, 0))
        port = other.getsockname()[1]
        other.listen()
        assert not port_free("127.0.0.1", port)
        with pytest.raises(OSError):
            bind("127.0.0.1", port).close()
    assert port_free("127.0.0.1", port)


def test_free_port_gives_a_port_a_server_can_listen_on():
    port = free_port()
    assert port > 0 and port_free("127.0.0.1", port)
    with bind("127.0.0.1", port) as sock:
        sock.listen()
        assert sock.getsockname()[1] == port
