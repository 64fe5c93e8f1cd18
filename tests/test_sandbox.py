"""The python tool's sandbox: it fences hostile code wherever the interpreter lives, and fails closed.

The hostile catalogue (tests/sandbox_catalogue.py: fork bomb, kill(-1), daemons, escapes) runs each
case as PID 1 of a PID namespace of its own, so that a regression that falls open takes down that
case only, never this test process or the suite beside it; it runs on the local backend with the
interpreter where it lies and reached through a symlink in /tmp, and through the sandbox_fusion
backend. The other tests here run harmless code in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from postrl.agents import call_tool, load_tools, run_python, sandbox_description
from postrl.agents.sandbox import sandbox as sandbox_mod
from postrl.agents.sandbox.sandbox import BOOT, CallStats, isolation
from postrl.agents.tools.tools import start_python_tool
from postrl.errors import UserError
from postrl.sandbox_limits import SandboxLimits

SMALL = SandboxLimits(memory_mb=256, max_processes=8, max_output_bytes=4096)


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
    res = run_python("import sys\nprint(6 * 7)\nprint('note', file=sys.stderr)", SMALL, timeout_s=10, stats=stats)
    assert (res.stdout, res.stderr, res.exit_status, res.error) == ("42\n", "note\n", 0, None)
    assert not (res.timed_out or res.killed or res.truncated)
    assert stats.as_metrics() == {"sandbox/success": 1, "sandbox/error": 0, "sandbox/timeout": 0}


def test_an_exception_is_an_error_result_with_the_traceback():
    res = run_python("raise ValueError('bad input')", SMALL, timeout_s=10)
    assert res.error == "exit" and res.exit_status == 1
    assert "ValueError: bad input" in res.stderr


def test_the_environment_is_empty_and_the_working_directory_fresh():
    code = "import os, json\nprint(json.dumps({'env': sorted(os.environ), 'files': os.listdir('.'), 'cwd': os.getcwd()}))"
    first, second = (json.loads(run_python(code, SMALL, timeout_s=10).stdout) for _ in range(2))
    assert first["env"] == ["HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"]
    assert first["files"] == ["main.py"] and second["files"] == ["main.py"]
    assert first["cwd"] != second["cwd"]
    assert not Path(first["cwd"]).exists(), "the working directory is removed after the call"


def test_the_description_is_one_line_that_says_what_is_isolated():
    line = sandbox_description()
    assert "\n" not in line and line.startswith("sandbox: ")
    assert ("no network (network namespace)" in line) == isolation().namespaces




# ------------------------------------------------------------------------------ the hostile catalogue
from sandbox_catalogue import CASES  # noqa: E402 - tests/ is on the path (conftest)

CATALOGUE = Path(__file__).with_name("sandbox_catalogue.py")
SRC = str(Path(sandbox_mod.__file__).parents[3])
# The prefix that starts a case as PID 1 of a PID namespace of its own (a user namespace too when not root).
FENCE = [shutil.which("unshare") or "unshare", *([] if os.geteuid() == 0 else ["--map-current-user"]),
         "--pid", "--fork", "--mount-proc", "--kill-child"]


def _fence_works() -> str:
    """'' where FENCE makes a process PID 1, else why not."""
    probe = subprocess.run([*FENCE, sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=30)
    return "" if probe.stdout.strip() == "1" else f"no PID namespace for the catalogue's cases ({probe.stderr.strip()[-200:]})"


# What this machine cannot contain is probed once, at collection: such a test is skipped with the reason (pytest -ra lists
# it) and conftest's summary counts them ("containment: N tests could not run here"). Never a skip inside a test.
NO_FENCE = _fence_works()
NO_ISOLATION = "" if isolation().namespaces else sandbox_description()  # the sandbox refuses every case (tested below)
needs_isolation = pytest.mark.skipif(bool(NO_ISOLATION), reason=f"containment: {NO_ISOLATION}")


@pytest.fixture(scope="module")
def fence() -> list[str]:
    probe = _fence_works()
    assert not probe, probe  # collection found it working: never run hostile code without it
    return FENCE


@pytest.fixture(scope="module")
def interpreter_via_tmp():
    """This interpreter reached through a symlink in /tmp to its venv (the layout that used to fall open)."""
    link = Path(tempfile.mkdtemp(prefix="postrl-venv-", dir="/tmp")) / "venv"
    link.symlink_to(os.path.realpath(sys.prefix))
    yield str(link / os.path.relpath(sys.executable, sys.prefix))
    shutil.rmtree(link.parent)


@pytest.mark.skipif(bool(NO_FENCE), reason=f"containment: {NO_FENCE}")
@needs_isolation
@pytest.mark.parametrize("where", ["local", "local-via-tmp", "sandbox_fusion"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_hostile_catalogue_is_contained(case, where, fence, interpreter_via_tmp):
    python = interpreter_via_tmp if where == "local-via-tmp" else sys.executable
    backend = "sandbox_fusion" if where == "sandbox_fusion" else "local"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{SRC}:{CATALOGUE.parent}", "OMP_NUM_THREADS": "1",
           "HOME": os.path.expanduser("~")}
    proc = subprocess.run([*fence, python, str(CATALOGUE), backend, case], capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 0 and f"held: {backend} {case}" in proc.stdout, proc.stdout + proc.stderr


@needs_isolation
def test_a_venv_reached_through_tmp_is_isolated(interpreter_via_tmp):
    """It used to fall open there: covering /tmp hid the interpreter, the probe failed, the code ran as root."""
    code = "from postrl.agents.sandbox.sandbox import isolation, run_python\nprint(isolation().namespaces, run_python('import os; print(os.getuid())', timeout_s=10).stdout)"
    proc = subprocess.run([interpreter_via_tmp, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC})
    assert proc.stdout.split() == ["True", str(65534 if os.geteuid() == 0 else os.getuid())], proc.stderr


@needs_isolation
@pytest.mark.parametrize("scratch", [pytest.param(d, marks=pytest.mark.skipif(not os.path.isdir(d), reason=f"containment: no {d} here"))
                                     for d in ("/tmp", "/var/tmp", "/dev/shm")])  # fmt: skip
def test_a_venv_in_a_scratch_directory_stays_usable_inside(scratch):
    """A checkout's venv under a directory the sandbox covers with a fresh tmpfs is bound back read-only."""
    home = Path(tempfile.mkdtemp(prefix="postrl-venv-", dir=scratch))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], check=True, timeout=60)
        import pyseccomp  # the seccomp filter's builder, which the sandbox needs: this venv finds it where it lies

        site = next((home / "venv" / "lib").glob("python3*/site-packages"))
        (site / "pyseccomp.pth").write_text(os.path.dirname(pyseccomp.__file__) + "\n")
        code = ("from postrl.agents.sandbox.sandbox import isolation, run_python\n"
                "r = run_python('import os, sys\\nprint(os.getuid(), sys.prefix)\\nopen(sys.prefix + \"/x\", \"w\")', timeout_s=10)\n"
                "print(isolation().namespaces, r.stdout.strip(), r.stderr.strip().splitlines()[-1])")
        proc = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC})
        uid = 65534 if os.geteuid() == 0 else os.getuid()
        assert proc.stdout.split(" ", 3) == ["True", str(uid), str(home / "venv"), "OSError: [Errno 30] Read-only file system: "
                                            f"'{home / 'venv'}/x'\n"], proc.stdout + proc.stderr
    finally:
        shutil.rmtree(home)


# --------------------------------------------------------------------------------------- fail closed
REFUSED = "unshare refused: unshare: unshare failed: Operation not permitted"


@pytest.fixture
def no_isolation(tmp_path, monkeypatch):
    """`unshare` refused, as in a container without CAP_SYS_ADMIN: a fake one first on PATH."""
    fake = tmp_path / "bin" / "unshare"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    isolation.cache_clear()
    yield
    isolation.cache_clear()


def test_without_isolation_the_python_tool_runs_nothing_and_says_how_to_fix(no_isolation, tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nprint('ran')"
    tools = load_tools(["builtin:python"])
    res = call_tool(tools, "python", {"code": code}, 5)
    assert not isolation().namespaces and REFUSED in isolation().description
    assert res.status == "error" and res.text.startswith("the python tool is unavailable: ") and "ran\n" not in res.text
    assert REFUSED in res.text and "Fix:" in res.text and "backend: sandbox_fusion" in res.text
    stats = CallStats()
    direct = run_python(code, SMALL, timeout_s=10, stats=stats)
    assert (direct.error, direct.stdout, direct.exit_status) == ("isolation", "", None)
    assert stats.as_metrics() == {"sandbox/success": 0, "sandbox/error": 1, "sandbox/timeout": 0}
    with pytest.raises(UserError, match="cannot isolate it"):
        start_python_tool({"backend": "local", "require_isolation": True})
    if os.geteuid() == 0:  # the opt-out is never honoured as root
        res = run_python(code, replace(SMALL, require_isolation=False), timeout_s=10)
        assert res.error == "isolation" and "never honoured as root" in res.stderr
        with pytest.raises(UserError, match="never honoured as root"):
            start_python_tool({"backend": "local", "require_isolation": False})
    assert not marker.exists()
    # The remote backend does not need this machine's namespaces.
    start_python_tool({"backend": "sandbox_fusion", "url": "http://127.0.0.1:9"})


def _system_python() -> str:
    """'' where /usr/bin/python3 (>= 3.10) runs the package's sandbox, else why not."""
    if not Path("/usr/bin/python3").exists():
        return "no system Python (/usr/bin/python3)"
    version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info >= (3, 10))"], capture_output=True, text=True)
    return "" if version.stdout.strip() == "True" else "/usr/bin/python3 is older than 3.10"


def _filter_builds(python: str) -> bool:
    """Whether `python` builds the seccomp filter (pyseccomp and libseccomp)."""
    code = f"import sys; sys.path.insert(0, {SRC!r})\nfrom {sandbox_mod.__name__} import seccomp_program\nseccomp_program()"
    return subprocess.run([python, "-I", "-c", code], capture_output=True, timeout=60).returncode == 0


SYSTEM_PYTHON = _system_python()
NO_FILTERLESS_PYTHON = SYSTEM_PYTHON or ("the system Python builds the seccomp filter too" if _filter_builds("/usr/bin/python3") else "")


@pytest.mark.skipif(bool(NO_FILTERLESS_PYTHON), reason=f"containment: {NO_FILTERLESS_PYTHON}")
def test_without_the_seccomp_filter_nothing_runs(tmp_path):
    """An interpreter that cannot build the filter (no pyseccomp, as the system Python here; or no libseccomp)
    gets the refusal, with the fix, and runs nothing, though the namespaces would work."""
    marker = tmp_path / "ran"
    script = (f"import sys; sys.path.insert(0, {SRC!r})\n"
              "from postrl.agents.sandbox.sandbox import isolation, run_python\n"
              f"r = run_python({f'open({str(marker)!r}, chr(119))'!r}, timeout_s=10)\n"
              "print(isolation().namespaces, r.error)\nprint(r.stderr)")
    proc = subprocess.run(["/usr/bin/python3", "-I", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert proc.stdout.splitlines()[0] == "False isolation", proc.stdout + proc.stderr
    assert "seccomp filter unavailable: ModuleNotFoundError" in proc.stdout and "Fix: install libseccomp" in proc.stdout
    assert not marker.exists()

@pytest.mark.parametrize("command", ["check-config", "train"])
def test_without_isolation_check_config_and_train_refuse_builtin_python(no_isolation, tmp_path, command, capsys):
    from postrl.cli import main

    config = tmp_path / "tool.yaml"
    config.write_text("model: {path: builtin:tiny-qwen2}\nrollout:\n  multi_turn: {enable: true, tools: ['builtin:python']}\n"
                      f"logging: {{dir: {tmp_path / 'run'}}}\n")
    assert main([command, str(config)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "rollout.multi_turn.tools: the python tool (builtin:python) runs model-written code" in out
    assert REFUSED in out and "Fix:" in out and "sandbox_fusion" in out
    assert not (tmp_path / "run").exists()  # stopped before anything started
    # The calculator needs no sandbox; the remote backend needs no namespaces here.
    assert main(["check-config", str(config), "rollout.multi_turn.tools=[builtin:calculator]"]) == 0
    assert main(["check-config", str(config), "rollout.multi_turn.sandbox.backend=sandbox_fusion",
                 "rollout.multi_turn.sandbox.url=http://sandbox:8080"]) == 0


def test_every_limit_is_read_from_the_yaml_and_reaches_the_sandbox(tmp_path):
    from postrl.checks import load_config

    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[builtin:python]",
                             "rollout.multi_turn.sandbox.max_output_bytes=300", "rollout.multi_turn.sandbox.max_file_mb=1",
                             "rollout.multi_turn.sandbox.memory_mb=200"])
    tools = load_tools(["builtin:python"], sandbox_limits=cfg.rollout.multi_turn.sandbox.model_dump())
    assert call_tool(tools, "python", {"code": "print('z' * 500)"}, 5).text.startswith("z" * 300 + "\n[output cut at 300 bytes")
    res = call_tool(tools, "python", {"code": "open('f', 'wb').write(b'x' * 2**21)"}, 5)
    assert "File too large" in res.text
    assert "MemoryError" in call_tool(tools, "python", {"code": "b = bytearray(300 * 2**20)"}, 5).text
    with pytest.raises(UserError, match="no url names it"):
        load_config(None, ["model.path=builtin:tiny-qwen2", "rollout.multi_turn.sandbox.backend=sandbox_fusion"])


USERNS_SCRIPT = r"""
import json, os, sys
from dataclasses import replace
from postrl.agents.sandbox.sandbox import isolation, run_python
from postrl.sandbox_limits import SandboxLimits
target = sys.argv[1]
small = SandboxLimits(memory_mb=256, max_processes=8)
opted_out = replace(small, require_isolation=False)
out = {"uid": os.getuid(), "namespaces": isolation().namespaces, "description": isolation().description}
if not isolation().namespaces:  # refused; then the opt-out, which an ordinary user may take
    from postrl.agents.tools.tools import start_python_tool
    out["refused"] = run_python("print('ran')", small, timeout_s=10).stderr
    said = []
    start_python_tool({"backend": "local", "require_isolation": False}, said.append)
    out["said"] = said
    res = run_python("import os\nprint(os.getuid())", opted_out, timeout_s=10)
    out["opted_out"] = [res.error, res.stdout]
    res = run_python("while True:\n    pass", opted_out, timeout_s=1.0)
    out["opted_out_timeout"] = res.error
    print(json.dumps(out))
    sys.exit(0)
res = run_python(f"import os\nprint(os.getuid())\nopen({target!r}, 'w').write('pwned')", small, timeout_s=10)
out["write"] = [res.error, res.stdout, res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""]
res = run_python("import os\nwhile True:\n    os.fork()", small, timeout_s=2.0)
out["fork"] = res.error
res = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", small, timeout_s=10)
out["net"] = res.stderr.strip().splitlines()[-1]
res = run_python("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())", small, timeout_s=10)
out["remount"] = res.stdout
print(json.dumps(out))
"""


def _as_ordinary_user(code: str, shared: str, path: str = "/usr/bin:/bin", *args: str) -> subprocess.CompletedProcess:
    """`code` run by the system Python as uid 65533, the package and `shared` (pyseccomp's copy) on its path."""
    return subprocess.run(
        ["/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", "/usr/bin/python3", "-I", "-c",
         f"import sys; sys.path[:0] = [{SRC!r}, {shared!r}]\n" + code, *args],
        capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": path, "HOME": "/"},
    )


def _shared_dir() -> str:
    """A world-writable directory beside this file (outside /tmp, which the sandbox replaces) with pyseccomp's copy."""
    import pyseccomp  # the filter's builder (one pure-Python file), where uid 65533 and the system Python find it

    shared = tempfile.mkdtemp(prefix="postrl-userns-", dir=Path(__file__).parent)
    os.chmod(shared, 0o777)
    shutil.copy(pyseccomp.__file__, shared)
    return shared


def _ordinary_user() -> str:
    """'' where an ordinary uid gets the sandbox's namespaces here (a user namespace), else why not."""
    shared = _shared_dir()
    try:
        proc = _as_ordinary_user(f"from {sandbox_mod.__name__} import isolation\nprint(isolation().namespaces, isolation().description)", shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return "" if proc.stdout.startswith("True ") else f"an ordinary user gets no namespaces here: {(proc.stdout + proc.stderr).strip()[-300:]}"


USERNS_CAN_RUN = SYSTEM_PYTHON if os.geteuid() == 0 and Path("/usr/bin/setpriv").exists() else "needs root (to become an ordinary uid with setpriv)"
ORDINARY_USER = USERNS_CAN_RUN or _ordinary_user()


@pytest.mark.skipif(bool(USERNS_CAN_RUN), reason=f"containment: {USERNS_CAN_RUN}")
@pytest.mark.parametrize("userns", [pytest.param("allowed", marks=pytest.mark.skipif(bool(ORDINARY_USER), reason=f"containment: {ORDINARY_USER}")),
                                    "refused"])  # fmt: skip
def test_an_ordinary_user_gets_the_same_fences_through_a_user_namespace(userns):
    """The path most users take: not root, so `unshare -r` (an unprivileged user namespace) and every
    capability dropped instead of uid 65534. Run as uid 65533 with the system Python (the package's
    sandbox needs only the standard library). Where user namespaces are refused (a fake `unshare`), the
    refusal names both ways out, and the opt-out runs the code as that uid under the limits."""
    shared = _shared_dir()  # world-writable and outside /tmp: only the read-only mount stops the write
    target = os.path.join(shared, "escape.txt")
    path = "/usr/bin:/bin"
    if userns == "refused":
        fake = Path(shared) / "bin"  # where uid 65533 can reach it (pytest's tmp_path is private)
        fake.mkdir()
        (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
        (fake / "unshare").chmod(0o755)
        path = f"{fake}:{path}"
    try:
        proc = _as_ordinary_user(USERNS_SCRIPT, shared, path, target)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        if userns == "refused":
            assert not out["namespaces"] and "allow unprivileged user namespaces" in out["refused"], out
            assert "backend: sandbox_fusion" in out["refused"] and "require_isolation: false" in out["refused"]
            assert out["opted_out"] == [None, "65533\n"] and out["opted_out_timeout"] == "timeout"
            assert len(out["said"]) == 1 and out["said"][0].startswith("WARNING: sandbox: NOT isolated (unshare refused")
            return
        assert out["namespaces"], out["description"]  # collection found an ordinary user gets them
        assert out["uid"] == 65533 and out["description"].endswith("no capabilities")
        # The checkout is not in the sandbox's allowlisted file system at all: the directory is not there.
        assert out["write"][0] == "exit" and out["write"][1] == "0\n" and "No such file or directory" in out["write"][2], out["write"]
        assert not os.path.exists(target)
        assert out["fork"] in ("exit", "timeout")
        assert "Network is unreachable" in out["net"]
        assert out["remount"] == "-1 1\n"  # EPERM: the code cannot make the file system writable again
    finally:
        shutil.rmtree(shared, ignore_errors=True)
