"""The python tool on a remote SandboxFusion service (bytedance/SandboxFusion), for clusters where the
local sandbox's namespaces are refused (rollout.multi_turn.sandbox.backend: sandbox_fusion).

`run_remote(code, url=..., ...)` POSTs {code, language: python, run_timeout, memory_limit_MB} to
`<url>/run_code` and turns the answer ({status, message, run_result: {status, stdout, stderr,
return_code, execution_time}}) into the local sandbox's `SandboxResult`, with the same error kinds, so
the tool's text and the metrics do not depend on the backend. It never raises:
- connection errors and 429 / 502 / 503 answers are retried (`retries`, exponential back-off), through
  urllib3's Retry; a request that reached the service is not sent again (the code may have run);
- the request's time limit is the run's plus `request_slack_s` (queueing, transfer); past it, "timeout";
- at most `concurrency` requests per service are in flight from this process; further calls wait;
- stdout and stderr are each cut at `max_output_bytes` ("output_limit", as the local sandbox);
- an unreachable service, an HTTP error or a SandboxError answer is "setup" (our side, not the model's).
The isolation is the service's (docs/agents.md says how to run it beside a cluster).
"""

from __future__ import annotations

import threading
import time
from functools import lru_cache

from postrl.agents.sandbox import CallStats, SandboxResult

_slots_lock = threading.Lock()
_slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}


def _slot(url: str, concurrency: int) -> threading.BoundedSemaphore:
    with _slots_lock:
        return _slots.setdefault((url, concurrency), threading.BoundedSemaphore(concurrency))


@lru_cache(maxsize=8)
def _session(retries: int, pool: int):
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    retry = Retry(total=retries, connect=retries, read=0, status=retries, other=0, backoff_factor=0.2,
                  status_forcelist=(429, 502, 503), allowed_methods=None, raise_on_status=False)
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_connections=1, pool_maxsize=pool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _cut(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode("utf-8", "replace")
    return (raw[:limit].decode("utf-8", "ignore"), True) if len(raw) > limit else (text, False)


def run_remote(
    code: str,
    *,
    url: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 16_384,
    concurrency: int = 8,
    retries: int = 3,
    connect_timeout_s: float = 5.0,
    request_slack_s: float = 10.0,
    stats: CallStats | None = None,
) -> SandboxResult:
    """Run `code` on the SandboxFusion service at `url` (see the module docstring); never raises."""
    res = _request(code, url.rstrip("/"), timeout_s, memory_mb, max_output_bytes, concurrency, retries,
                   connect_timeout_s, request_slack_s)
    if stats is not None:
        stats.record("ok" if res.error is None else res.error)
    return res


def _request(code, url, timeout_s, memory_mb, max_output_bytes, concurrency, retries, connect_timeout_s, slack_s):
    import requests

    body = {"code": code, "language": "python", "run_timeout": timeout_s, "memory_limit_MB": memory_mb}
    start = time.monotonic()
    with _slot(url, concurrency):
        try:
            reply = _session(retries, concurrency).post(f"{url}/run_code", json=body, timeout=(connect_timeout_s, timeout_s + slack_s))
        except requests.exceptions.ConnectionError as exc:
            why = f"the SandboxFusion service at {url} is unreachable after {retries} retries ({type(exc).__name__})"
            return SandboxResult("", why, None, error="setup", duration_s=time.monotonic() - start)
        except requests.exceptions.Timeout:
            return SandboxResult("", f"no answer from {url} within {timeout_s + slack_s:g} s", None, timed_out=True,
                                 error="timeout", duration_s=time.monotonic() - start)
        except requests.exceptions.RequestException as exc:
            return SandboxResult("", f"request to {url} failed: {exc}", None, error="setup", duration_s=time.monotonic() - start)
    duration = time.monotonic() - start
    try:
        answer = reply.json() if reply.status_code == 200 else None
    except ValueError:
        answer = None
    run = answer.get("run_result") if isinstance(answer, dict) else None
    if not isinstance(run, dict):
        what = f"HTTP {reply.status_code}" if answer is None else f"{answer.get('status')}: {answer.get('message') or ''}"
        return SandboxResult("", f"the SandboxFusion service at {url} did not run the code ({what}; {reply.text[:300]!r})",
                             None, error="setup", duration_s=duration)
    return _result(run, max_output_bytes, timeout_s, duration)


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
