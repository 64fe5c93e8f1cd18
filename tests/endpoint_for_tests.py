"""A live rollout endpoint over the real HF engine on the tiny model, held open mid-rollout for a test to probe.

`live(**rollout)` starts `AgentGateway.generate` on a thread of its own (that thread is the engine thread)
with one program that hands its session's base URL to the test and waits; when the test is done the
program sends one well-formed request (`Live.last`: its status) and returns.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from postrl.agents.endpoint.gateway import AgentGateway
from postrl.builtin.tiny import build_tiny_model
from postrl.config import RolloutConfig
from postrl.rollout.base import SamplingParams

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
_MODEL: dict = {}


def tiny() -> tuple[Any, Any]:
    """The tiny tool-calling model and its tokenizer (loaded once per process)."""
    if not _MODEL:
        import torch
        from transformers import AutoTokenizer

        from postrl.models import load_model

        torch.manual_seed(0)
        path = str(build_tiny_model("tiny-qwen2-tools"))
        _MODEL["tok"], _MODEL["model"] = AutoTokenizer.from_pretrained(path), load_model(path).eval()
    return _MODEL["model"], _MODEL["tok"]


@dataclass
class Live:
    url: str  # the session's base URL: http://127.0.0.1:<port>/s/<key>/v1
    gateway: AgentGateway
    thread: threading.Thread  # the engine thread
    release: threading.Event = field(default_factory=threading.Event)
    last: dict = field(default_factory=dict)

    @property
    def host_port(self) -> tuple[str, int]:
        hostport = self.url.split("//")[1].split("/")[0]
        return hostport.rsplit(":", 1)[0], int(hostport.rsplit(":", 1)[1])

    def raw(self, data: bytes, timeout: float = 20.0) -> bytes:
        """Send `data` on a fresh connection and read until the server closes it or answers one response."""
        with socket.create_connection(self.host_port, timeout=timeout) as sock:
            sock.sendall(data)
            return read_response(sock)


def read_response(sock: socket.socket) -> bytes:
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return got
        if not chunk:
            return got
        got += chunk
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                return got


@contextlib.contextmanager
def live(max_tokens: int = 8, **rollout: Any):
    model, tok = tiny()
    from postrl.rollout.hf import HFEngine

    urls: queue.Queue = queue.Queue()
    holder: dict = {}

    def agent(client, row):
        urls.put(str(client.base_url).rstrip("/"))
        holder["live"].release.wait(600)
        r = client.with_options(max_retries=0).chat.completions.with_raw_response.create(model=client.model, messages=QUESTION, max_tokens=2)
        holder["live"].last.update(status=r.http_response.status_code)
        return None

    cfg = RolloutConfig(agent="x:y", agent_timeout_s=600, agent_batch_wait_ms=1, **rollout)
    gw = AgentGateway(HFEngine(model, tok), tok, cfg, model=model, agent=agent, max_model_len=512)
    out: dict = {}

    def engine_thread() -> None:
        out["c"] = gw.generate([tok.apply_chat_template(QUESTION, add_generation_prompt=True)], SamplingParams(max_tokens=max_tokens, greedy=True), rows=[{}])

    t = threading.Thread(target=engine_thread, name="engine", daemon=True)
    holder["live"] = lv = Live("", gw, t)
    t.start()
    try:
        lv.url = urls.get(timeout=120)
        yield lv
        lv.release.set()
        t.join(120)
        assert not t.is_alive() and "c" in out, "the rollout did not end"
    finally:
        lv.release.set()
        gw.close()
