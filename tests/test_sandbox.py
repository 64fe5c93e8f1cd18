"""The sandbox catalogue: hostile code costs its own call only.

Each case runs model-like code with small limits and checks four things: the call returns an
error result (it never raises), this test process carries on, nothing outside changed, and
nothing of the run is left running. Cases that only the namespaces can guarantee (no network, no
writes outside, signals that cannot reach us) skip with the sandbox's own description where
`unshare` is refused.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest

from postrl.agents import run_python, sandbox_description
from postrl.agents import sandbox as sandbox_mod
from postrl.agents.sandbox import BOOT, CallStats, isolation

needs_namespaces = pytest.mark.skipif(not isolation().namespaces, reason=sandbox_description())
SMALL = dict(timeout_s=3.0, memory_mb=256, max_processes=8, max_output_bytes=4096)


def _processes(match) -> list[int]:
    """Pids of live (not zombie) processes whose /proc entry satisfies `match(pid)`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "Z" and match(entry.name):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _ppid(pid: str) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[1]


def _sandbox_processes() -> list[int]:
    """This test process's sandbox launchers and inits (children or grandchildren naming _boot.py)."""
    me = str(os.getpid())

    def ours(pid: str) -> bool:
        return str(BOOT) in _cmdline(pid) and me in (_ppid(pid), _ppid(_ppid(pid)))

    return _processes(ours)


def _none_left(match=None, within_s: float = 5.0) -> bool:
    """True once no sandbox process (and none matching `match`) is alive; the kernel reaps a dead
    namespace's processes asynchronously, so give it a moment."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _sandbox_processes() and not (match and _processes(match)):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def nothing_left_running():
    assert _none_left(), f"sandbox processes alive before the test: {_sandbox_processes()}"
    yield
    assert _none_left(), f"sandbox processes left running: {_sandbox_processes()}"


def test_a_clean_run_returns_stdout_and_status_zero():
    stats = CallStats()
    res = run_python("import sys\nprint(6 * 7)\nprint('note', file=sys.stderr)", stats=stats, **SMALL)
    assert (res.stdout, res.stderr, res.exit_status, res.error) == ("42\n", "note\n", 0, None)
    assert not (res.timed_out or res.killed or res.truncated)
    assert stats.as_metrics() == {"sandbox/success": 1, "sandbox/error": 0, "sandbox/timeout": 0}


def test_an_exception_is_an_error_result_with_the_traceback():
    res = run_python("raise ValueError('bad input')", **SMALL)
    assert res.error == "exit" and res.exit_status == 1
    assert "ValueError: bad input" in res.stderr


def test_the_environment_is_empty_and_the_working_directory_fresh():
    code = "import os, json\nprint(json.dumps({'env': sorted(os.environ), 'files': os.listdir('.'), 'cwd': os.getcwd()}))"
    import json

    first, second = (json.loads(run_python(code, **SMALL).stdout) for _ in range(2))
    assert first["env"] == ["HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"]
    assert first["files"] == ["main.py"] and second["files"] == ["main.py"]
    assert first["cwd"] != second["cwd"]
    assert not Path(first["cwd"]).exists(), "the working directory is removed after the call"


def test_infinite_loop_is_killed_at_the_time_limit():
    stats = CallStats()
    res = run_python("while True:\n    pass", stats=stats, **{**SMALL, "timeout_s": 1.0})
    assert res.error == "timeout" and res.timed_out and res.killed and res.exit_status is None
    assert stats.as_metrics() == {"sandbox/success": 0, "sandbox/error": 0, "sandbox/timeout": 1}


def test_fork_bomb_hits_the_process_limit():
    code = "import os\nwhile True:\n    os.fork()"
    res = run_python(code, **{**SMALL, "timeout_s": 2.0, "max_processes": 8})
    assert res.error in ("exit", "timeout"), res
    if res.error == "exit":
        assert "BlockingIOError" in res.stderr or "Resource temporarily unavailable" in res.stderr


def test_memory_bomb_hits_the_address_space_limit():
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))", **{**SMALL, "memory_mb": 200})
    assert res.error == "memory" and res.exit_status == 1, res
    assert "MemoryError" in res.stderr


def test_huge_output_is_cut_and_the_writer_stopped():
    res = run_python("while True:\n    print('x' * 1000)", **{**SMALL, "max_output_bytes": 5000})
    assert res.error == "output_limit" and res.truncated and res.killed
    assert len(res.stdout) == 5000 and set(res.stdout) <= {"x", "\n"}


def test_a_large_file_hits_the_file_size_limit():
    res = run_python("open('big', 'wb').write(b'x' * (8 * 2**20))", **{**SMALL, "max_file_mb": 1})
    assert res.error == "exit" and "File too large" in res.stderr


@needs_namespaces
def test_writing_outside_its_directory_changes_nothing(tmp_path):
    inside_ours = tmp_path / "escape.txt"  # a path this test owns
    shared_tmp = Path("/tmp") / f"postrl-escape-{random.getrandbits(64):x}"  # world-writable /tmp
    code = f"for p in ({str(inside_ours)!r}, {str(shared_tmp)!r}):\n    try:\n        open(p, 'w').write('pwned')\n        print('wrote', p)\n    except OSError as e:\n        print('refused', p, e.strerror)\n"
    res = run_python(code, **SMALL)
    assert res.error is None, res
    assert f"refused {inside_ours}" in res.stdout  # read-only file system (and another uid as root)
    assert f"wrote {shared_tmp}" in res.stdout  # the sandbox's private /tmp ...
    assert not inside_ours.exists() and not shared_tmp.exists()  # ... which vanished with it
    assert list(tmp_path.iterdir()) == []


@needs_namespaces
def test_the_callers_home_is_hidden():
    import json
    import sys

    home = os.path.expanduser("~")
    res = run_python(f"import os, json\nprint(json.dumps(os.listdir({home!r})))", **SMALL)
    assert res.error is None, res
    # Only the way to the interpreter (e.g. ~/.pyenv when Python lives there) is bound back in.
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.executable)}
    way_in = {Path(p).relative_to(home).parts[0] for p in interpreter if p.startswith(home.rstrip("/") + "/")}
    assert set(json.loads(res.stdout)) == way_in


def test_closing_its_output_does_not_end_the_call_early():
    res = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.5)\nraise SystemExit(3)", **SMALL)
    assert (res.error, res.exit_status, res.timed_out) == ("exit", 3, False)
    res = run_python("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", **{**SMALL, "timeout_s": 1.0})
    assert res.error == "timeout" and res.killed


@needs_namespaces
def test_network_connect_to_a_loopback_server_fails():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
        res = run_python(code, **SMALL)
        assert res.error == "exit" and "connected" not in res.stdout
        assert "OSError" in res.stderr or "Error" in res.stderr.splitlines()[-1], res.stderr
        with pytest.raises(socket.timeout):
            server.accept()  # nobody knocked


def test_killing_its_parent_does_not_kill_the_caller():
    me = os.getpid()
    res = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')", **SMALL)
    assert os.getpid() == me  # this process carries on
    assert res.error is not None or res.stdout == "still here\n"  # the kill failed, or hit only the sandbox's init


@needs_namespaces
def test_signalling_every_process_reaches_only_the_sandbox():
    helper = os.fork()
    if helper == 0:  # a bystander process outside the sandbox
        time.sleep(30)
        os._exit(0)
    try:
        res = run_python("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('sent')", **SMALL)
        assert res.error in (None, "exit", "signal")
        assert os.waitpid(helper, os.WNOHANG) == (0, 0), "the bystander must still be alive"
    finally:
        os.kill(helper, 9)
        os.waitpid(helper, 0)


def test_a_daemonised_child_does_not_outlive_the_call():
    marker = f"{50 + random.random() * 9:.9f}"  # /bin/sleep's argument doubles as a unique tag
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "print('daemon started')\n"
    )
    res = run_python(code, **SMALL)
    assert res.stdout == "daemon started\n" and res.error is None

    def sleeper(pid: str) -> bool:
        return _cmdline(pid).strip() == f"sleep {marker}"

    if not isolation().namespaces:  # the group kill cannot reach a child that left the session
        pytest.skip(f"daemons escape without a PID namespace: {sandbox_description()}")
    assert _none_left(sleeper), "the daemon is still running"


def test_without_namespaces_limits_still_hold(monkeypatch):
    """The fallback path (unshare refused) still kills at the limit and cuts the output."""
    monkeypatch.setattr(sandbox_mod, "isolation", lambda: sandbox_mod._fallback("forced by the test"))
    assert "network NOT isolated (forced by the test)" in sandbox_mod._fallback("forced by the test").description
    assert run_python("print('hi')", **SMALL).stdout == "hi\n"
    assert run_python("while True:\n    pass", **{**SMALL, "timeout_s": 1.0}).error == "timeout"
    res = run_python("while True:\n    print('x' * 1000)", **{**SMALL, "max_output_bytes": 2000})
    assert res.error == "output_limit" and len(res.stdout) == 2000
    me = os.getpid()
    res = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')", **SMALL)
    assert os.getpid() == me and res.stdout == "still here\n"  # its parent is the sandbox's own process
    # A background child that keeps the pipes open does not hold the call until its time limit.
    res = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(30)\nprint('done')", **{**SMALL, "timeout_s": 20.0})
    assert res.error is None and res.stdout == "done\n" and res.duration_s < 15


def test_the_description_is_one_line_that_says_what_is_isolated():
    line = sandbox_description()
    assert "\n" not in line and line.startswith("sandbox: ")
    assert ("no network (network namespace)" in line) == isolation().namespaces


USERNS_SCRIPT = r"""
import json, os, sys
from postrl.agents.sandbox import isolation, run_python
target = sys.argv[1]
small = dict(timeout_s=3.0, memory_mb=256, max_processes=8)
out = {"uid": os.getuid(), "namespaces": isolation().namespaces, "description": isolation().description}
res = run_python(f"import os\nprint(os.getuid())\nopen({target!r}, 'w').write('pwned')", **small)
out["write"] = [res.error, res.stdout, res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""]
res = run_python("import os\nwhile True:\n    os.fork()", **{**small, "timeout_s": 2.0})
out["fork"] = res.error
res = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", **small)
out["net"] = res.stderr.strip().splitlines()[-1]
res = run_python("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())", **small)
out["remount"] = res.stdout
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists() or not Path("/usr/bin/python3").exists(),
                    reason="needs root (to become an ordinary uid with setpriv) and /usr/bin/python3 (>= 3.10)")
def test_an_ordinary_user_gets_the_same_fences_through_a_user_namespace():
    """The path most users take: not root, so `unshare -r` (an unprivileged user namespace) and every
    capability dropped instead of uid 65534. Run as uid 65533 with the system Python (the package's
    sandbox needs only the standard library)."""
    import json
    import shutil
    import subprocess
    import tempfile

    version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True).stdout.strip()
    if version != "True":
        pytest.skip("/usr/bin/python3 is older than 3.10")
    # World-writable and outside /tmp (which the sandbox replaces): only the read-only mount stops the write.
    shared = tempfile.mkdtemp(prefix="postrl-userns-", dir=Path(__file__).parent)
    os.chmod(shared, 0o777)
    target = os.path.join(shared, "escape.txt")
    try:
        proc = subprocess.run(
            ["/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", "/usr/bin/python3", "-I", "-c",
             f"import sys; sys.path.insert(0, {str(Path(sandbox_mod.__file__).parents[2])!r})\n" + USERNS_SCRIPT, target],
            capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        if not out["namespaces"]:
            pytest.skip(out["description"])
        assert out["uid"] == 65533 and out["description"].endswith("no capabilities")
        assert out["write"][0] == "exit" and out["write"][1] == "0\n" and "Read-only file system" in out["write"][2]
        assert not os.path.exists(target)
        assert out["fork"] in ("exit", "timeout")
        assert "Network is unreachable" in out["net"]
        assert out["remount"] == "-1 1\n"  # EPERM: the code cannot make the file system writable again
    finally:
        shutil.rmtree(shared, ignore_errors=True)
