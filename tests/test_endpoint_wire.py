"""The endpoint below the JSON (agents/endpoint/server.py): protocol upgrades, header bytes and counts, slow clients, the
connection gate. Real sockets on 127.0.0.1 against a live endpoint over the HF engine on the tiny model; every
wait is on a condition with a deadline."""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from endpoint_for_tests import live, read_response

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _wait_open(lv, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(lv.gateway._server.gate.open) != n:
        assert time.monotonic() < deadline, f"{len(lv.gateway._server.gate.open)} connections open, not {n}"
        time.sleep(0.01)


def _path(lv) -> str:
    return lv.url.split(lv.url.split("/")[2])[1]


def _closed(sock: socket.socket) -> bool:
    """The server closed `sock`: read until EOF or reset (TimeoutError past the socket's timeout fails the test)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_upgrades_and_slow_clients_beyond_the_connection_cap_leave_the_gate_and_a_normal_request_is_answered():
    cap = 4
    with live(agent_max_connections=cap, agent_concurrency=1, agent_header_timeout_s=0.5, agent_body_timeout_s=0.5) as lv:
        path = _path(lv)
        upgrades = {
            "websocket": "connection: Upgrade\r\nupgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n",
            "h2c": "connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        }
        held = []
        for k in range(cap + 2):  # more upgrades than the cap, each on a connection kept open
            s = socket.create_connection(lv.host_port, timeout=20)
            s.sendall(f"GET {path}/models HTTP/1.1\r\nhost: x\r\n{upgrades['websocket' if k % 2 else 'h2c']}\r\n".encode())
            r = read_response(s)
            # not taken: answered as plain HTTP on the same connection (or 503 while the cap is full)
            assert r.startswith(b"HTTP/1.1 200") or r.startswith(b"HTTP/1.1 503"), r[:200]
            assert not r.startswith(b"HTTP/1.1 101")
            held.append(s)
        slow = []
        for _ in range(cap + 2):  # then slow clients: half a header block each, and a trickled body
            s = socket.create_connection(lv.host_port, timeout=20)
            s.sendall(f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\n".encode())
            slow.append(s)
        s = socket.create_connection(lv.host_port, timeout=20)
        s.sendall(f"POST {path.replace('/s/', '/s/nobody')}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n{{".encode())
        slow.append(s)
        # every one of them leaves the gate: the upgraded ones idle past the header timeout, the slow ones too
        assert all(_closed(s) for s in held + slow)
        _wait_open(lv, 0)
        r = httpx.post(lv.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        for s in held + slow:
            s.close()
        # an HTTP/2 preface (h2 prior knowledge): its first line is a request for `*` (404), its rest not HTTP (400, closed)
        with socket.create_connection(lv.host_port, timeout=20) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert read_response(s).startswith(b"HTTP/1.1 404") and _closed(s)
        _wait_open(lv, 0)
        assert lv.thread.is_alive()
    assert lv.last["status"] == 200


def test_a_body_nobody_reads_closes_the_connection_after_its_answer():
    with live(agent_header_timeout_s=0.5, agent_body_timeout_s=0.5) as lv:
        path = _path(lv)
        for route in (f"{path.replace('/s/', '/s/nobody')}/chat/completions", f"{path}/embeddings"):  # 404 before the body
            with socket.create_connection(lv.host_port, timeout=20) as s:
                s.sendall(f"POST {route} HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n\r\n\r\n".encode())
                r = read_response(s)
                assert r.startswith(b"HTTP/1.1 404") and b"connection: close" in r.lower(), r[:300]
                assert _closed(s)  # now (the socket's 20 s timeout), not when the body would be complete
        _wait_open(lv, 0)
    assert lv.last["status"] == 200


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_oversize_headers_and_too_many_headers_are_refused_and_memory_stays_bounded():
    with live() as lv:
        path = _path(lv)
        before = _rss()
        sent = 0
        with socket.create_connection(lv.host_port, timeout=20) as s:
            s.sendall(f"GET {path}/models HTTP/1.1\r\nhost: x\r\nx-big: ".encode())
            chunk = b"a" * 2**16
            try:
                while sent < 256 * 2**20:  # the old server read 200 MiB of one header and grew by as much
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            got = read_response(s)
        assert sent < 32 * 2**20, f"the server read {sent} bytes of headers"  # 16 KiB + the sockets' buffers
        assert got == b"" or got.startswith(b"HTTP/1.1 400")
        assert _rss() - before < 64 * 2**20
        many = "".join(f"x-h{k}: v\r\n" for k in range(150))  # 150 headers, 1.5 KiB: under the bytes, over the count
        r = lv.raw(f"GET {path}/models HTTP/1.1\r\nhost: x\r\n{many}\r\n".encode())
        assert r.startswith(b"HTTP/1.1 431") and b"at most 100" in r
        fine = "".join(f"x-h{k}: v\r\n" for k in range(90))
        assert lv.raw(f"GET {path}/models HTTP/1.1\r\nhost: x\r\n{fine}\r\n".encode()).startswith(b"HTTP/1.1 200")
        assert lv.gateway.pop_metrics()["agent/bad_requests"] == 1
        _wait_open(lv, 0)
    assert lv.last["status"] == 200


def test_a_client_that_never_reads_its_answers_is_closed_after_the_body_timeout():
    """Pipelined requests whose answers the client never takes: the server's socket buffers fill, the answer's
    `send` waits on uvicorn's drain; the connection is closed `agent_body_timeout_s` after that answer started
    (the header timeout, 60 s here, is not what closes it)."""
    with live(agent_header_timeout_s=60, agent_body_timeout_s=0.5) as lv:
        path = _path(lv).replace("/s/", "/s/nobody")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small buffers: the answers back up at once,
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the requests soon after
        s.connect(lv.host_port)
        s.setblocking(False)
        requests = f"POST {path}/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode() * 200_000
        sent, reset = 0, False
        while sent < len(requests) and not reset and select.select([], [s], [], 2.0)[1]:  # until the server stops
            try:  # reading for 2 s (its answer waits on the client, which never reads) or resets the connection
                sent += s.send(memoryview(requests)[sent : sent + 65536])
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                reset = True
        assert 0 < sent < len(requests)
        _wait_open(lv, 0)
        s.close()
        r = httpx.get(lv.url + "/models", timeout=30)
        assert r.status_code == 200
    assert lv.last["status"] == 200
