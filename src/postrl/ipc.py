"""The one channel between postrl and its child processes (agent program workers, the verifier pool, verifiers
environments): JSON frames.

A frame is its length (4 bytes, big-endian, signed: multiprocessing's `Connection.send_bytes` framing, so a
child may write with that) and then that many bytes of UTF-8 JSON. Whoever opens a channel states its caps
there: the bytes one frame may hold (a longer frame is refused from its header, before a byte of it is read)
and how long a frame may take to arrive whole (None: for ever, where something else bounds the wait). A
frame's JSON is read with its depth capped; nothing is ever unpickled. Every refusal is one `FrameError`; a
channel that ends between frames, or mid-frame (the child died: its death, not its message, is what to
report), is EOFError. The placement's batch wire (placement/wire.py) is the one exchange that is not this.

The standard library only, never postrl: a child in a venv without postrl (the verifiers environment's,
agents/verifiers/worker.py) loads this file by its path and speaks the same frames.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, Protocol, Union

HEADER = struct.Struct("!i")  # multiprocessing's frame header: a signed big-endian length (-1: a frame over 2 GiB)
MAX_DEPTH = 64  # a frame's JSON nests at most this deep unless its channel says otherwise


class FrameError(Exception):
    """A frame that the channel does not allow: too long, cut short, not JSON, too deep, or (said by whoever
    checks its shape) not of the expected shape."""


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


Channel = Union[int, _HasFileno]  # a file descriptor, a socket, a multiprocessing Connection, a pipe's file


def encode(obj: Any) -> bytes:
    """One frame holding `obj` as JSON (TypeError / ValueError when it is not JSON-able)."""
    return frame(json.dumps(obj).encode())


def frame(data: bytes) -> bytes:
    """One frame holding `data` (bytes the sender already made JSON)."""
    return HEADER.pack(len(data)) + data


def recv_bytes(channel: Channel, max_bytes: int, timeout_s: float | None) -> bytes:
    """The next frame's bytes: FrameError when it is longer than `max_bytes` (refused from its header) or does
    not arrive whole within `timeout_s` of this call (None: no limit); EOFError when the channel ends."""
    fd = channel if isinstance(channel, int) else channel.fileno()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    (n,) = HEADER.unpack(_read_exact(fd, HEADER.size, deadline))
    if not 0 <= n <= max_bytes:
        raise FrameError(f"a frame of {n if n >= 0 else 'over 2**31'} bytes (at most {max_bytes})")
    return _read_exact(fd, n, deadline)


def recv(channel: Channel, max_bytes: int, timeout_s: float | None, max_depth: int = MAX_DEPTH) -> Any:
    """The next frame's value (`recv_bytes`, then `loads`)."""
    return loads(recv_bytes(channel, max_bytes, timeout_s), max_depth)


def loads(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """A frame's JSON value; FrameError when it is not JSON or nests deeper than `max_depth`. JSON's NaN and
    Infinity parse: what a value may be is the receiver's shape check."""
    try:
        value = json.loads(data)
        deep = json_depth(value, max_depth) > max_depth
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"a frame that is not JSON ({type(exc).__name__})") from None
    except RecursionError:
        deep = True
    if deep:
        raise FrameError(f"a frame that is not JSON within {max_depth} levels of nesting")
    return value


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of a JSON value (an object or array is 1 deeper than its members), counted without
    recursion and given up past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    poller = select.poll()  # not select.select: a busy trainer's descriptors run past 1024
    poller.register(fd, select.POLLIN)
    while len(buf) < n:
        if deadline is not None:
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise FrameError(f"a frame cut short ({len(buf)} of {n} bytes arrived in time)")
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the channel ended" + (f" mid-frame ({len(buf)} of {n} bytes)" if buf else ""))
        buf += chunk
    return bytes(buf)
