"""A stand-in SandboxFusion service for the tests, on 127.0.0.1: POST /run_code runs the code in postrl's
own local sandbox (so the tests run real code, fenced) and answers in SandboxFusion's shape:
{status, message, compile_result, run_result: {status, execution_time, return_code, stdout, stderr}, files}.

It counts requests, records the most in flight at once, and can answer the first `fail_first`
requests with `fail_status` (503 by default) and `fail_headers` (e.g. Retry-After), or every answer with
`reply_bytes` bytes of body (streamed, to test the client's byte cap).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from postrl.agents.sandbox.sandbox import run_python
from postrl.sandbox_limits import SandboxLimits


class FakeSandboxFusion:
    def __init__(self, fail_first: int = 0, fail_status: int = 503, fail_headers: dict | None = None, reply_bytes: int = 0,
                 content_length: bool = True):
        self.fail_status, self.fail_headers = fail_status, dict(fail_headers or {})
        self.reply_bytes, self.content_length = reply_bytes, content_length
        self.sent = 0  # body bytes the server got out before the client hung up (reply_bytes)
        self.requests = 0
        self.inflight = self.max_inflight = 0
        self.fail_first = fail_first
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeSandboxFusion":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def run(self, body: dict) -> dict:
        res = run_python(body["code"], SandboxLimits(memory_mb=int(body["memory_limit_MB"])), timeout_s=float(body["run_timeout"]))
        if res.error in ("setup", "isolation"):
            return {"status": "SandboxError", "message": res.stderr, "compile_result": None, "run_result": None, "files": {}}
        status = "TimeLimitExceeded" if res.timed_out else "Finished"
        code = res.exit_status if res.exit_status is not None else -9  # killed (output limit): SIGKILL
        run = {"status": status, "execution_time": res.duration_s, "return_code": None if res.timed_out else code,
               "stdout": res.stdout, "stderr": res.stderr}
        return {"status": "Success" if code == 0 else "Failed", "message": "", "compile_result": None, "run_result": run, "files": {}}

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service._lock:
                    service.requests += 1
                    failing = service.requests <= service.fail_first
                    service.inflight += 1
                    service.max_inflight = max(service.max_inflight, service.inflight)
                    service.bodies.append(body)
                try:
                    if self.path != "/run_code" or failing:
                        payload, status = b"busy", service.fail_status if failing else 404
                    elif service.reply_bytes:
                        return self._huge()
                    else:
                        payload, status = json.dumps(service.run(body)).encode(), 200
                finally:
                    with service._lock:
                        service.inflight -= 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for name, value in (service.fail_headers.items() if failing else ()):
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def _huge(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if service.content_length:
                    self.send_header("Content-Length", str(service.reply_bytes))
                self.end_headers()
                chunk = b" " * 65536  # JSON whitespace: a valid start of a reply that never ends in time
                try:
                    while service.sent < service.reply_bytes:
                        self.wfile.write(chunk)
                        service.sent += len(chunk)
                except OSError:  # the client hung up
                    pass
                self.close_connection = True

        return Handler
