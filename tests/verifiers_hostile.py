"""Verifiers that act as a worker compromised through model output would: from inside the verifier worker they
write their own frame into the worker's reply pipe, ahead of the worker's real reply
(tests/test_verifier_pool_frames.py). Named 'verifiers_hostile:<fn>'; workers find them through PYTHONPATH."""

import gc
import json
import math
import os
import pickle
import struct
import sys
import time
from multiprocessing.connection import Connection


class Evil:
    """Unpickling it creates the file `marker`: proof that the reader ran code from the frame."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _reply_pipe() -> Connection:
    (conn,) = [o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed and o.writable]
    return conn


def _reply(task: int, **fields) -> bytes:
    frame = {"kind": "reply", "task": task, "status": "ok", "message": "", "result": {"score": 1.0, "metrics": {"acc": 1.0}}}
    return json.dumps({**frame, **fields}).encode()


def sends(completion: str, ground_truth: str, row: dict) -> float:
    """Writes the frame named by `completion` (the marker file's path in `ground_truth`), then scores 1."""
    task = sys._getframe(1).f_locals["task_id"]  # the worker's loop, which called this verifier
    conn = _reply_pipe()
    if completion == "cut_short":  # a header that promises 10,000 bytes, one byte, then nothing
        os.write(conn.fileno(), struct.pack("!i", 10_000) + b"{")
        time.sleep(3600)
    frame = {
        "pickle": lambda: pickle.dumps(Evil(ground_truth)),
        "garbage": lambda: b"\x00\xff not JSON at all",
        "oversize": lambda: b" " * (row["max_bytes"] + 1),
        "score_str": lambda: _reply(task, result={"score": "1.0", "metrics": {}}),
        "metrics_list": lambda: _reply(task, result={"score": 1.0, "metrics": [["acc", 1.0]]}),
        "other_task": lambda: _reply(task + 1000),
    }[completion]()
    conn.send_bytes(frame)
    return 1.0


def exact(completion: str, ground_truth: str, row: dict) -> dict:
    """Floats that a decimal round trip would change if it were not exact, and metrics that are not finite."""
    return {"score": 0.1 + 0.2, "third": 1 / 3, "tiny": 5e-324, "nan": math.nan, "inf": -math.inf}


def many_metrics(completion: str, ground_truth: str, row: dict) -> dict:
    """A result too large for one reply frame."""
    return {"score": 1.0, **{f"metric_{i:05d}": float(i) for i in range(10_000)}}
