"""postrl/ipc.py, the one frame channel to child processes: caps from the header, a deadline per frame, depth-capped
JSON, one error type, EOF told apart; over a real pipe, a real socket pair and a child process's pipes."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl import ipc
from postrl.ipc import HEADER, FrameError


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def test_frames_round_trip_over_a_pipe_in_order(pipe):
    r, w = pipe
    os.write(w, ipc.encode({"a": [1, 2.5, None]}) + ipc.encode("two") + ipc.frame(b"3"))
    assert [ipc.recv(r, 100, 1.0) for _ in range(3)] == [{"a": [1, 2.5, None]}, "two", 3]


def test_a_frame_over_the_cap_is_refused_from_its_header_alone(pipe):
    r, w = pipe
    os.write(w, HEADER.pack(101))  # no body follows: refusing it must not wait for one
    with pytest.raises(FrameError, match=r"^a frame of 101 bytes \(at most 100\)$"):
        ipc.recv(r, 100, None)
    os.write(w, HEADER.pack(-1))  # multiprocessing's mark of a frame over 2 GiB
    with pytest.raises(FrameError, match=r"over 2\*\*31 bytes \(at most 100\)"):
        ipc.recv(r, 100, None)
    os.write(w, ipc.frame(b" " * 100))  # exactly the cap passes (whitespace is not JSON, though)
    with pytest.raises(FrameError, match="not JSON"):
        ipc.recv(r, 100, None)


def test_a_frame_that_does_not_arrive_whole_in_time_is_cut_short(pipe):
    r, w = pipe
    os.write(w, HEADER.pack(10) + b'["ab')
    with pytest.raises(FrameError, match=r"^a frame cut short \(4 of 10 bytes arrived in time\)$"):
        ipc.recv(r, 100, 0.05)
    os.write(w, HEADER.pack(2)[:1])
    with pytest.raises(FrameError, match=r"\(1 of 4 bytes arrived in time\)"):  # the header has the same deadline
        ipc.recv(r, 100, 0.05)


def test_the_end_of_the_channel_is_eof_between_frames_and_mid_frame(pipe):
    r, w = pipe
    os.write(w, ipc.encode(1) + HEADER.pack(10) + b"[1")
    os.close(w)
    assert ipc.recv(r, 100, 1.0) == 1
    with pytest.raises(EOFError, match=r"mid-frame \(2 of 10 bytes\)"):  # a child's death, not a bad message
        ipc.recv(r, 100, 1.0)
    with pytest.raises(EOFError, match="^the channel ended$"):
        ipc.recv(r, 100, 1.0)


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\x80\x04 not json", r"not JSON \(UnicodeDecodeError\)"),
        (b"{'a': 1}", r"not JSON \(JSONDecodeError\)"),
        (pickle.dumps({"a": 1}), "not JSON"),
        (b"[" * 65 + b"]" * 65, "within 64 levels"),
        (b"[" * 100_000 + b"]" * 100_000, "within 64 levels"),  # past the parser's recursion: refused, not raised
    ],
)
def test_frames_that_are_not_json_or_too_deep_are_refused(data, why):
    with pytest.raises(FrameError, match=why):
        ipc.loads(data)


def test_depth_is_the_channels_to_state_and_json_constants_parse():
    assert ipc.loads(b"[" * 64 + b"]" * 64) is not None and ipc.loads(b"[[[1]]]", max_depth=3) == [[[1]]]
    with pytest.raises(FrameError, match="within 2 levels"):
        ipc.loads(b"[[[1]]]", max_depth=2)
    assert math.isnan(ipc.loads(b"NaN"))  # what a value may be is the receiver's shape check


def test_a_socket_pair_carries_frames_both_ways_and_a_closed_peer_is_eof():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(ipc.encode(["key", "ok", 0.5]))
        assert ipc.recv(b, 1000, None) == ["key", "ok", 0.5]
        sender = threading.Thread(target=b.sendall, args=(ipc.encode({"big": "x" * 300_000}),))  # past the buffer
        sender.start()
        assert len(ipc.recv(a, 400_000, 10.0)["big"]) == 300_000
        sender.join()
        a.close()
        with pytest.raises(EOFError):
            ipc.recv(b, 1000, None)


def test_multiprocessings_send_bytes_frames_are_this_channels_frames():
    a, b = mp.Pipe(duplex=True)
    with a, b:
        a.send_bytes(json.dumps({"kind": "ready", "pid": 7}).encode())
        assert ipc.recv(b, 100, 1.0) == {"kind": "ready", "pid": 7}
        os.write(b.fileno(), ipc.encode([1, 2]))
        assert json.loads(a.recv_bytes()) == [1, 2]


CHILD = """
import sys
from postrl import ipc
n = ipc.recv(sys.stdin, 100, 10.0)
for i in range(n):
    sys.stdout.buffer.write(ipc.encode({"i": i, "square": i * i}))
sys.stdout.buffer.write(ipc.frame(b"not json"))
sys.stdout.buffer.write(ipc.HEADER.pack(1 << 30))
sys.stdout.buffer.flush()
"""


def test_a_child_process_on_the_other_end():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdin.write(ipc.encode(3))
        proc.stdin.flush()
        got = [ipc.recv(proc.stdout, 100, 10.0) for _ in range(3)]
        assert got == [{"i": 0, "square": 0}, {"i": 1, "square": 1}, {"i": 2, "square": 4}]
        with pytest.raises(FrameError, match="not JSON"):
            ipc.recv(proc.stdout, 100, 10.0)
        with pytest.raises(FrameError, match=f"a frame of {1 << 30} bytes"):
            ipc.recv(proc.stdout, 100, 10.0)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(EOFError):
            ipc.recv(proc.stdout, 100, 10.0)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=50, deadline=2000)
@given(value=json_values)
def test_any_json_value_round_trips(value):
    r, w = os.pipe()
    try:
        data = ipc.encode(value)
        assert len(data) < 60_000  # fits the pipe's buffer: written before it is read
        os.write(w, data)
        assert ipc.recv(r, len(data), 1.0) == value
    finally:
        os.close(r)
        os.close(w)
