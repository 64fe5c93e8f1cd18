"""Services over a trainer: the Tinker API (`postrl serve-tinker`), so the official `tinker` SDK and the
tinker-cookbook's loops train and sample against postrl on the user's own machine (docs/tinker.md).

    engine.py   one base model, a LoRA adapter per training client and per saved sampler, postrl's log-probs,
                sampling with vLLM (the sampler's adapter merged in) or HF generate
    losses.py   Tinker's loss names as postrl's formulas (algorithms/)
    wire.py     the SDK's protobuf payloads <-> tensors, bounded
    app.py      HTTP: routes, the key, the limits, the engine thread and its futures
    service.py  what each route does
"""

from __future__ import annotations

import ipaddress
import signal
import threading
from typing import Any

from postrl.errors import UserError


def check_listen(host: str, allow_remote: bool, api_key: str) -> list[str]:
    """Problems with where and how the server would listen (loopback unless opted in; a key the SDK accepts)."""
    problems = []
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        problems.append(
            f"--host {host} is not a loopback address: anyone who can reach it could train and sample on this machine "
            "with the key. Fix: keep the default 127.0.0.1 (and reach it through an SSH tunnel), or pass --allow-remote."
        )
    if not api_key:
        problems.append("--api-key is required (or TINKER_API_KEY): every request but /api/v1/healthz must carry it.")
    elif not api_key.startswith("tml-") or len(api_key) < 12:
        problems.append(
            "--api-key must start with 'tml-' (the tinker SDK refuses any other key) and be at least 12 characters, "
            "e.g. tml-$(python -c 'import secrets; print(secrets.token_hex(16))')."
        )
    return problems


def serve(cfg: Any, *, host: str, port: int, api_key: str, state_dir: str = "runs/tinker", name: str | None = None,
          allow_remote: bool = False, max_samplers: int = 32, limits: Any = None, http: Any = None, log=print, stop: threading.Event | None = None,
          ready=None) -> None:
    """Serve the Tinker API over `cfg.model.path` until SIGTERM / SIGINT (or `stop` is set); then a running sample
    ends at its next token and fails, the request running otherwise finishes, the queued ones fail with "the
    server is stopping", and every training client's state is saved as `<state_dir>/<model_id>/weights/on-exit`
    (load it with its tinker:// path). Samples come from vLLM where `cfg.rollout.engine` allows it, else HF."""
    from postrl.agents.endpoint.server import Gate, HttpLimits, Server, Tally
    from postrl.serve.app import Limits, make_app
    from postrl.serve.engine import Engine
    from postrl.serve.service import Service

    problems = check_listen(host, allow_remote, api_key)
    if problems:
        raise UserError(*problems, title="postrl serve-tinker cannot start")
    try:
        import tinker  # noqa: F401 - the request models and protobufs are the SDK's own
    except ImportError:
        raise UserError("the tinker SDK is not installed. Fix: `make setup` (or `pip install -e '.[tinker]'`).") from None
    if allow_remote:
        log(f"WARNING: listening on {host}, not loopback (--allow-remote): anyone who reaches it with the key can use it")
    limits, http = limits or Limits(), http or HttpLimits(max_body_bytes=256 * 2**20)
    engine = Engine(cfg.model.path, name or cfg.model.path, state_dir, cfg.model.dtype, tiny=cfg.model.tiny, max_samplers=max_samplers,
                    rollout=cfg.rollout, log=log, micro_tokens=cfg.train.max_token_len_per_device)
    service = Service(engine, limits)
    refused = Tally()
    gate = Gate(http, refused)
    server = Server(make_app(service, api_key, http, limits, refused), host=host, port=port, gate=gate)
    url = f"http://{host}:{server.port}"
    log(f"postrl serve-tinker: '{engine.name}' on {url} (TINKER_BASE_URL={url}; health: {url}/api/v1/healthz)")
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready(server.port, service)
    try:
        stop.wait()
    finally:
        server.close()  # no new requests
        engine.stopping.set()  # a running sample ends at its next token
        dropped = service.jobs.cancel_queued("the server is stopping (SIGTERM); this request was not run")
        if dropped:
            log(f"postrl serve-tinker: {dropped} queued requests not run")
        for line in service.save_all("on-exit"):
            log(f"postrl serve-tinker: {line}")
        service.close()
        engine.close()
        log(f"postrl serve-tinker: stopped ({refused.pop()} requests refused while serving)")
