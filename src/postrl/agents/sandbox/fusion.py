"""The python tool on a remote SandboxFusion service (bytedance/SandboxFusion), for clusters where the
local sandbox's namespaces are refused (rollout.multi_turn.sandbox.backend: sandbox_fusion).

`run_remote(code, limits, timeout_s=...)` POSTs {code, language: python, run_timeout, memory_limit_MB} to
`<url>/run_code` and turns the answer ({status, message, run_result: {status, stdout, stderr,
return_code, execution_time}}) into the local sandbox's `SandboxResult`, with the same error kinds, so
the tool's text and the metrics do not depend on the backend. It never raises:
- only a connection that could not be made is retried (`retries`, exponential back-off, urllib3's
  Retry). A request that reached the service is never sent again, whatever came back (a 502 / 503 from
  a proxy, a dropped connection): the code may already have run;
- a 429 / 503 answer with `Retry-After` fails this call and holds back the next ones to that service for
  that long, at most `retry_after_max_s`;
- the request's time limit is the run's plus `request_slack_s` (queueing, transfer); past it, "timeout";
- at most `concurrency` requests per service are in flight from this process; further calls wait;
- the reply is read up to `max_reply_bytes` (uncompressed: the request asks for no encoding and a
  compressed reply is refused); a longer one is "output_limit", as the local sandbox's long output;
- stdout and stderr are each cut at `max_output_bytes` ("output_limit", as the local sandbox);
- an unreachable service, an HTTP error or a SandboxError answer is "setup" (our side, not the model's).
Plain http:// to a host other than loopback carries the code and its output unencrypted and
unauthenticated: `plain_http_warning` says so (at the tool's start and once in the log).
The isolation is the service's (docs/agents.md says how to run it beside a cluster).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from email.utils import parsedate_to_datetime
from functools import lru_cache
from urllib.parse import urlsplit

from postrl.agents.sandbox.sandbox import CallStats, SandboxResult
from postrl.sandbox_limits import SandboxLimits
from postrl.utils import is_loopback

log = logging.getLogger(__name__)

_slots_lock = threading.Lock()
_slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_not_before: dict[str, float] = {}  # url -> monotonic time before which no request is sent (Retry-After)
_CHUNK = 65536


def _slot(url: str, concurrency: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault((url, concurrency), threading.BoundedSemaphore(concurrency))


@lru_cache(maxsize=8)
def _session(retries: int, pool: int):
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    # connect: errors before anything was sent (refused, unreachable, connect timeout): safe to send again.
    # read / status / other: 0, the request may have reached the service and run.
    retry = Retry(total=retries, connect=retries, read=0, status=0, other=0, redirect=0, backoff_factor=0.2,
                  status_forcelist=(), allowed_methods=None, raise_on_status=False, respect_retry_after_header=False)
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_connections=1, pool_maxsize=pool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def plain_http_warning(url: str) -> str | None:
    """A warning when `url` sends the code in the clear to a host other than this machine's loopback, else None."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme != "http" or is_loopback(host):
        return None
    return (f"WARNING: rollout.multi_turn.sandbox.url is plain http:// to {host}: the model's code and its output "
            "cross the network unencrypted and unauthenticated (anyone on the path can read or change them, or answer "
            "in the service's place). Use https:// (e.g. behind a TLS proxy), or keep the service on a private network.")


@lru_cache(maxsize=64)
def _warn_once(url: str) -> None:
    if (warning := plain_http_warning(url)) is not None:
        log.warning(warning)


def _cut(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode("utf-8", "replace")
    return (raw[:limit].decode("utf-8", "ignore"), True) if len(raw) > limit else (text, False)


def run_remote(code: str, limits: SandboxLimits, *, timeout_s: float, stats: CallStats | None = None) -> SandboxResult:
    """Run `code` on the SandboxFusion service at `limits.url` under `limits` for at most `timeout_s` (see the module
    docstring); never raises."""
    url = (limits.url or "").rstrip("/")
    _warn_once(url)
    res = _request(code, url, timeout_s, limits)
    if stats is not None:
        stats.record("ok" if res.error is None else res.error)
    return res


def _request(code: str, url: str, timeout_s: float, limits: SandboxLimits) -> SandboxResult:
    import requests
    import urllib3

    body = {"code": code, "language": "python", "run_timeout": timeout_s, "memory_limit_MB": limits.memory_mb}
    limit_s = timeout_s + limits.request_slack_s
    retries, concurrency = limits.retries, limits.concurrency
    with _slot(url, concurrency):
        _hold_back(url, limits.retry_after_max_s)
        start = time.monotonic()
        try:
            reply = _session(retries, concurrency).post(f"{url}/run_code", json=body, stream=True,
                                                        timeout=(limits.connect_timeout_s, limit_s),
                                                        headers={"Accept-Encoding": "identity"})
            with reply:
                status, headers = reply.status_code, reply.headers
                raw, over = _read_capped(reply, limits.max_reply_bytes, start + limit_s)
        except requests.exceptions.ConnectionError as exc:  # connect errors, connect timeouts included
            why = f"the SandboxFusion service at {url} is unreachable after {retries} retries ({type(exc).__name__})"
            cause = exc.args[0] if exc.args else None
            if isinstance(getattr(cause, "reason", cause), urllib3.exceptions.ProtocolError):  # after the request went out
                why = f"the connection to the SandboxFusion service at {url} broke before its answer (not sent again: the code may have run)"
            return SandboxResult("", why, None, error="setup", duration_s=time.monotonic() - start)
        except (requests.exceptions.Timeout, urllib3.exceptions.TimeoutError, TimeoutError):
            return SandboxResult("", f"no answer from {url} within {limit_s:g} s", None, timed_out=True, error="timeout",
                                 duration_s=time.monotonic() - start)
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            return SandboxResult("", f"request to {url} failed: {exc}", None, error="setup", duration_s=time.monotonic() - start)
    duration = time.monotonic() - start
    if status in (429, 503):
        _note_retry_after(url, headers.get("Retry-After"), limits.retry_after_max_s)
    if over is not None:
        kind, why = over
        return SandboxResult("", f"{why}; the rest was not read", None, killed=True, truncated=kind == "output_limit",
                             error=kind, duration_s=duration)
    try:
        answer = json.loads(raw) if status == 200 else None
    except ValueError:
        answer = None
    run = answer.get("run_result") if isinstance(answer, dict) else None
    if not isinstance(run, dict):
        what = f"HTTP {status}" if not isinstance(answer, dict) else f"{answer.get('status')}: {answer.get('message') or ''}"
        return SandboxResult("", f"the SandboxFusion service at {url} did not run the code ({what}; "
                                 f"{raw[:300].decode('utf-8', 'replace')!r})", None, error="setup", duration_s=duration)
    return _result(run, limits.max_output_bytes, timeout_s, duration)


def _read_capped(reply, cap: int, deadline: float) -> tuple[bytes, tuple[str, str] | None]:
    """The reply's body, read up to `cap` bytes and until `deadline` (else TimeoutError); (what was read,
    None or (error kind, why) when it stopped early)."""
    encoding = reply.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return b"", ("setup", f"the service answered with Content-Encoding {encoding[:40]!r}, which was not asked for")
    length = reply.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > cap:
        return b"", ("output_limit", f"the reply ({int(length)} bytes) is longer than max_reply_bytes ({cap})")
    body = bytearray()
    for chunk in reply.raw.stream(_CHUNK, decode_content=False):
        body += chunk
        if len(body) > cap:
            return bytes(body[:cap]), ("output_limit", f"the reply is longer than max_reply_bytes ({cap})")
        if time.monotonic() > deadline:
            raise TimeoutError
    return bytes(body), None


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After as seconds from now (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


def _note_retry_after(url: str, value: str | None, cap_s: float) -> None:
    wait = _retry_after_s(value)
    if wait is None:
        return
    until = time.monotonic() + min(wait, cap_s)
    with _slots_lock:
        _not_before[url] = max(_not_before.get(url, 0.0), until)


def _hold_back(url: str, cap_s: float) -> None:
    """Wait out the service's last Retry-After (never more than `cap_s`)."""
    with _slots_lock:
        wait = _not_before.get(url, 0.0) - time.monotonic()
    if wait > 0:
        time.sleep(min(wait, cap_s))


def _result(run: dict, max_output_bytes: int, timeout_s: float, duration: float) -> SandboxResult:
    """SandboxFusion's run_result as the local sandbox's result (the same error kinds)."""
    stdout, cut_out = _cut(str(run.get("stdout") or ""), max_output_bytes)
    stderr, cut_err = _cut(str(run.get("stderr") or ""), max_output_bytes)
    code = run.get("return_code")
    code = 128 - code if isinstance(code, int) and code < 0 else code  # a negative code: killed by signal -code
    duration = float(run.get("execution_time") or duration)
    if run.get("status") == "TimeLimitExceeded":
        return SandboxResult(stdout, stderr, None, timed_out=True, killed=True, error="timeout", duration_s=duration)
    if cut_out or cut_err:
        stderr += f"\n[output cut at {max_output_bytes} bytes; the process was stopped]"
        return SandboxResult(stdout, stderr, None, killed=True, truncated=True, error="output_limit", duration_s=duration)
    if code == 0 and run.get("status") == "Finished":
        error = None
    elif "MemoryError" in stderr[-2000:]:
        error = "memory"
    elif isinstance(code, int) and code > 128:
        error = "signal"
    elif isinstance(code, int):
        error = "exit"
    else:
        error, stderr = "setup", f"the service ran nothing: run status {run.get('status')!r}\n{stderr}"
    return SandboxResult(stdout, stderr, code if isinstance(code, int) else None, error=error, duration_s=duration)
