"""How `serve` picks Triton's ports (deploy/server.py triton_ports), on a stand-in of the system's sockets that
does what Linux may do: a port is never handed out while a socket holds it, and the one just let go is handed
out again first. Triton refuses to start with two of its ports the same."""

from __future__ import annotations

import errno

import pytest

from andrea_export.deploy import server as server_mod


class _Sockets:
    """socket.socket as the system behaves: bind((host, 0)) gives the lowest port no open socket holds."""

    def __init__(self):
        self.held: set[int] = set()
        sockets = self

        class Socket:
            def __init__(self, family=None, kind=None):
                self.port = None

            def setsockopt(self, *args):
                pass

            def bind(self, address):
                host, port = address
                if port == 0:
                    port = next(p for p in range(40000, 60000) if p not in sockets.held)
                elif port in sockets.held:
                    raise OSError(errno.EADDRINUSE, "Address already in use")
                self.port = port
                sockets.held.add(port)

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def close(self):
                sockets.held.discard(self.port)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        self.socket = Socket


@pytest.fixture
def sockets(monkeypatch):
    s = _Sockets()
    monkeypatch.setattr(server_mod.socket, "socket", s.socket)
    return s


def test_free_ports_are_all_different_though_the_system_hands_a_closed_port_out_again(sockets):
    assert server_mod.free_port() == server_mod.free_port() == 40000  # the stand-in does what Linux may do
    ports = server_mod.triton_ports("127.0.0.1", 0, 0, 0)
    assert sorted(ports) == ["grpc", "http", "metrics"] and len(set(ports.values())) == 3
    assert sockets.held == set()  # let go, for Triton to take


def test_a_given_port_is_kept_and_the_free_ones_avoid_it(sockets):
    ports = server_mod.triton_ports("127.0.0.1", 0, 40000, 0)
    assert ports["grpc"] == 40000 and len(set(ports.values())) == 3


def test_two_given_ports_the_same_are_refused_in_one_line(sockets):
    with pytest.raises(server_mod.ServeError, match=r"^Triton's ports must differ: http 8000, grpc 8000$"):
        server_mod.triton_ports("127.0.0.1", 8000, 8000, 0)
