"""Run model-written Python as hostile input: one call, one fenced process tree, nothing left behind.

`run_python(code, limits, timeout_s=...)` starts `python -I` (isolated mode, the same interpreter) in a new session
with an empty environment and its own working directory, captures at most `max_output_bytes` of
output, and at the time limit kills the whole process group (SIGKILL to -pgid). It never raises for
anything the code does: the outcome is a `SandboxResult`.

Where the kernel allows it, the run also gets new network, PID, IPC and mount namespaces (util-linux
`unshare`; `-r`, an unprivileged user namespace, when not root), set up by `_boot.py`:
- no network: the namespace has only a loopback interface that is down, so every connect fails;
- no Unix sockets: a seccomp filter (built here with libseccomp, `seccomp_program`; loaded by _boot.py)
  makes socket(AF_UNIX) fail with EACCES, so no host service listening on a Unix socket (/run, /tmp, an
  abstract name) is reached; socketpair(AF_UNIX, SOCK_STREAM / SOCK_SEQPACKET) still works (datagram
  pairs, which could send to a path, do not); nor AF_VSOCK (a VM's host); io_uring, which would bypass
  the filter, is refused;
  a syscall of another ABI (i386, x32) kills the process;
- no shared IPC: System V and POSIX message queues / shared memory of the host are not visible;
- an allowlisted file system: the code's root is a fresh one (pivot_root) holding the system's programs and
  libraries, a few files of /etc, the interpreter's own trees (its venv, its base prefix) read-only, and
  fresh size-limited tmpfs on /tmp, /var/tmp, /dev/shm and the working directory that vanish with the
  namespace; the project's data (with its ground truth), checkpoints, logs, caches and home directories are
  not there to read (a reward-hacking path otherwise);
- nothing left running: the code runs under a small init (PID 1 of the namespace); when the code's
  process ends, the kernel kills every other process in the namespace, daemons included;
- no privileges: as root, the code runs as uid 65534 (so RLIMIT_NPROC binds); in a user namespace,
  with every capability dropped; no_new_privs in both.
Whether that works is checked once per process (`isolation()`), cached, and described in one line
(`sandbox_description()`) that the trainer prints at start.

It fails closed. Where `unshare` is refused, `run_python` executes nothing and returns an
"isolation" error whose text says why and how to fix it (`refusal()`; the config check and the
agent loop refuse a run with builtin:python at start with the same text). Only an ordinary user may
opt out (`require_isolation=False`, rollout.multi_turn.sandbox.require_isolation): the code then
gets the rlimits, the session and the group kill only, with a warning; as root, never.
docs/agents.md ("Tools and the sandbox") lists every limit and its default.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from postrl.sandbox_limits import DEFAULT, SandboxLimits

BOOT = Path(__file__).with_name("_boot.py")
SETUP_FAILED = 125  # _boot.py's exit code when a fence could not be built
NOBODY = 65534
# The code's environment: what Python needs to run, nothing of the caller's (no HOME, no tokens).
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65536


@dataclass
class SandboxResult:
    """What became of one run.

    `error` is None for a clean exit 0, else one of: "exit" (non-zero exit status, e.g. an uncaught
    exception), "memory" (MemoryError: the address-space limit), "signal" (killed by a signal, e.g.
    SIGXCPU at the CPU-time limit), "timeout" (wall-clock limit, the group was killed),
    "output_limit" (more than max_output_bytes of output, the group was killed), "setup" (the
    sandbox itself could not start; see stderr), "isolation" (refused: this machine cannot isolate
    the code; nothing ran; stderr says how to fix it).
    """

    stdout: str
    stderr: str
    exit_status: int | None  # the code's exit status; 128 + N when signal N ended it; None if killed by us
    timed_out: bool = False
    killed: bool = False  # we killed the process group (time or output limit)
    truncated: bool = False  # stdout or stderr was cut at max_output_bytes
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class CallStats:
    """Outcome counts of sandbox runs or tool calls, for the agent loop to log (thread-safe)."""

    success: int = 0
    error: int = 0
    timeout: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, status: str) -> None:
        """Count one call that ended "ok", "timeout" or anything else (an error)."""
        with self._lock:
            if status == "ok":
                self.success += 1
            elif status == "timeout":
                self.timeout += 1
            else:
                self.error += 1

    def as_metrics(self, prefix: str = "sandbox") -> dict[str, int]:
        return {f"{prefix}/success": self.success, f"{prefix}/error": self.error, f"{prefix}/timeout": self.timeout}


@dataclass(frozen=True)
class Isolation:
    """How runs are fenced on this machine (decided once per process)."""

    namespaces: bool  # network + PID + mount namespaces through unshare
    unshare_cmd: tuple[str, ...]  # the unshare prefix (empty when not used)
    drop_to_nobody: bool  # running as real root: the code runs as uid 65534
    description: str
    why: str = ""  # why the namespaces are unavailable (empty when they work)


def _unshare_cmd() -> tuple[str, ...] | None:
    unshare = shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.path.exists(p)), None)
    if unshare is None:
        return None
    user = () if os.geteuid() == 0 else ("--map-root-user",)
    return (unshare, *user, "--net", "--pid", "--ipc", "--mount", "--mount-proc", "--kill-child", "--propagation", "private",
            "--")


@lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The seccomp filter of the code's process as classic BPF for this machine's architecture, built once with
    libseccomp (pyseccomp): the architecture check (another ABI: kill), socket(AF_UNIX / AF_VSOCK) -> EACCES, datagram
    socketpair -> EACCES, io_uring -> EPERM, everything else allowed. Raises where libseccomp is missing."""
    import errno
    import socket

    import pyseccomp as sc

    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    # Masked compares look at the low 32 bits only, as the kernel does for an int argument: a family of
    # AF_UNIX + 2**32 must not pass as "not AF_UNIX". AF_VSOCK reaches the hypervisor's host, which no
    # network namespace fences either.
    for family in (socket.AF_UNIX, getattr(socket, "AF_VSOCK", 40)):
        flt.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, family))
    for kind in (socket.SOCK_DGRAM, socket.SOCK_RAW):  # AF_UNIX makes SOCK_RAW a datagram socket
        flt.add_rule(sc.ERRNO(errno.EACCES), "socketpair", sc.Arg(1, sc.MASKED_EQ, 0xF, kind))
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):  # its socket/connect skip seccomp
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Try a real run in the namespaces once; fall back (and say so) when the kernel refuses."""
    cmd = _unshare_cmd()
    if cmd is None:
        return _fallback("unshare not found; install util-linux")
    try:
        seccomp_program()
    except Exception as exc:  # noqa: BLE001 - no pyseccomp, no libseccomp.so, an old libseccomp: no filter, no run
        return _fallback(f"seccomp filter unavailable: {type(exc).__name__}: {exc}")
    trial = Isolation(True, cmd, os.geteuid() == 0, "")
    res = _run(_PROBE, trial, timeout_s=30.0, max_output_bytes=4096, memory_mb=512, cpu_s=30, max_processes=8,
               max_file_mb=1, max_open_files=64, tmpfs_mb=8)
    if res.ok and res.stdout.strip() == "isolated":
        who = "uid 65534" if trial.drop_to_nobody else "no capabilities"
        return Isolation(True, cmd, trial.drop_to_nobody,
                         f"sandbox: no network (network namespace); no Unix sockets (seccomp); own root file system (system and interpreter "
                         f"only, read-only), private /tmp; "
                         f"PID and IPC namespaces; {who}")
    if res.ok and res.stdout.strip() in ("connected", "unix socket"):
        return _fallback("a connection left the network namespace" if res.stdout.strip() == "connected" else
                         "the seccomp filter did not refuse socket(AF_UNIX)")
    why = (res.stderr.strip().splitlines() or [res.error or res.stdout.strip() or "unknown"])[-1][:400]
    return _fallback(why if why.startswith("sandbox setup:") else f"unshare refused: {why}")


# The trial run: no route out, no Unix socket, and a stream socketpair still works.
_PROBE = """import socket
try:
    socket.socket(socket.AF_UNIX).close()
    print('unix socket')
    raise SystemExit
except PermissionError:
    pass
a, b = socket.socketpair()
a.sendall(b'x')
assert b.recv(1) == b'x'
s = socket.socket()
s.settimeout(2)
try:
    s.connect(('1.1.1.1', 53))
    print('connected')
except OSError:
    print('isolated')
"""


def _fallback(why: str) -> Isolation:
    """No namespaces: nothing runs unless an ordinary user opted out of isolation (`refusal`)."""
    return Isolation(False, (), False, f"sandbox: NOT isolated ({why}): no network, file-system or PID isolation; "
                                       "code runs as your uid with rlimits only", why)


def refusal(require_isolation: bool = True, iso: Isolation | None = None) -> str | None:
    """Why the python tool may not run on this machine (what, why, how to fix), or None when it may."""
    iso = iso or isolation()
    if iso.namespaces:
        return None
    root = os.geteuid() == 0
    if not require_isolation and not root:
        return None
    what = (f"the python tool (builtin:python) runs model-written code, and this machine cannot isolate it "
            f"({iso.why}). ")
    remote = ("send the code to a SandboxFusion service instead: rollout.multi_turn.sandbox.backend: sandbox_fusion "
              "with rollout.multi_turn.sandbox.url (docs/agents.md, 'Tools and the sandbox')")
    if iso.why.startswith(("seccomp filter unavailable", "sandbox setup:")):  # namespaces work, a fence does not
        what += "Without that fence the code could reach what this machine keeps from it, so postrl refuses. "
        fix = ("Fix: " + ("install libseccomp (apt-get install libseccomp2, or your distribution's libseccomp) and the "
                          "pyseccomp package (pip install pyseccomp, a dependency of postrl)"
                          if iso.why.startswith("seccomp") else "remove the cause the setup line in parentheses names")
               + f", or {remote}.")
        return what + fix
    if root:
        if not require_isolation:
            what += ("rollout.multi_turn.sandbox.require_isolation: false is never honoured as root: the code would run "
                     "as root, with every right over this machine (its credentials, checkpoints, processes). ")
        else:
            what += ("Unisolated, the code would run as root, with every right over this machine (its credentials, "
                     "checkpoints, processes and network), so postrl refuses. ")
        fix = ("Fix: give the container what `unshare` needs (docker run --cap-add SYS_ADMIN --security-opt "
               "seccomp=unconfined --security-opt apparmor=unconfined, or CAP_SYS_ADMIN in the pod's securityContext), "
               f"or {remote}.")
    else:
        what += ("Unisolated, the code would run with your rights over this machine (your files, keys, processes and "
                 "network), so postrl refuses. ")
        fix = ("Fix: allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 where that key exists; "
               "user.max_user_namespaces > 0; on Ubuntu 24.04 kernel.apparmor_restrict_unprivileged_userns=0 or an "
               f"AppArmor profile for the interpreter), or {remote}; or, on a machine you are willing to expose, set "
               "rollout.multi_turn.sandbox.require_isolation: false.")
    return what + fix


def unisolated_warning() -> str:
    """The warning printed at the start of every run that opted out of isolation."""
    return (f"WARNING: {isolation().description}. rollout.multi_turn.sandbox.require_isolation is false: model-written "
            "code runs with your rights over this machine (files, keys, processes, network).")


def sandbox_description() -> str:
    """One line for the trainer to print at start: what the sandbox isolates on this machine."""
    return isolation().description


def run_python(code: str, limits: SandboxLimits = DEFAULT, *, timeout_s: float,
               stats: CallStats | None = None) -> SandboxResult:
    """Run `code` in the sandbox under `limits` (rollout.multi_turn.sandbox; docs/agents.md) for at most `timeout_s`.
    Never raises for anything the code does.

    `cpu_s` defaults to the wall-clock limit rounded up plus one second; `max_processes` counts the
    code's own processes and threads (added to what its uid already runs, as RLIMIT_NPROC counts per uid).
    Without isolation nothing runs (error "isolation"), unless `require_isolation=False` and not root.
    """
    refused = refusal(limits.require_isolation)
    if refused is not None:
        if stats is not None:
            stats.record("error")
        return SandboxResult("", refused, None, error="isolation")
    try:
        res = _run(code, isolation(), timeout_s=timeout_s, max_output_bytes=limits.max_output_bytes,
                   memory_mb=limits.memory_mb, cpu_s=limits.cpu_s if limits.cpu_s is not None else math.ceil(timeout_s) + 1,
                   max_processes=limits.max_processes, max_file_mb=limits.max_file_mb,
                   max_open_files=limits.max_open_files, tmpfs_mb=limits.tmpfs_mb)
    except Exception as exc:  # noqa: BLE001 - e.g. no free pid or fd in the parent: this call fails, not the caller
        res = SandboxResult("", f"sandbox could not start: {type(exc).__name__}: {exc}", None, error="setup")
    if stats is not None:
        stats.record("ok" if res.error is None else res.error)
    return res


def _tasks_of_uid(uid: int) -> int:
    """Tasks (processes and threads) the uid runs now: what RLIMIT_NPROC compares against."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def interpreter() -> str:
    """This interpreter by its real directory: a venv reached through a symlink (/tmp/x -> ~/venv) is named
    where it lies, so that the sandbox can bind it back; the file name is kept (a venv's bin/python is
    itself a link to the base interpreter, and following it would lose the venv)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def _run(code: str, iso: Isolation, *, timeout_s: float, max_output_bytes: int, memory_mb: int, cpu_s: int,
         max_processes: int, max_file_mb: int, max_open_files: int, tmpfs_mb: int) -> SandboxResult:
    if not iso.namespaces and os.geteuid() == 0:  # refusal() stops this first; a guard for any future caller
        return SandboxResult("", "sandbox: refusing to run code unisolated as root", None, error="isolation")
    python = interpreter()
    workdir = tempfile.mkdtemp(prefix="postrl-sandbox-")
    try:
        code_uid = NOBODY if iso.drop_to_nobody else os.getuid()
        # Real root is exempt from RLIMIT_NPROC, so a limit only binds for an ordinary uid.
        nproc = _tasks_of_uid(code_uid) + max_processes if code_uid != 0 else max_processes
        settings = {
            "isolate": iso.namespaces,
            "drop_to_nobody": iso.drop_to_nobody,
            "workdir": workdir,
            "python": python,
            "env": {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir},
            "cpu_s": int(cpu_s),
            "memory_mb": int(memory_mb),
            "file_mb": int(max_file_mb),
            "open_files": int(max_open_files),
            "nproc": int(nproc),
            "tmpfs_mb": int(tmpfs_mb),
            "seccomp": seccomp_program().hex() if iso.namespaces else "",
        }
        argv = [*iso.unshare_cmd, python, "-I", str(BOOT), json.dumps(settings)]
        return _supervise(argv, code.encode("utf-8", "replace"), workdir, timeout_s, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(argv: list[str], code: bytes, workdir: str, timeout_s: float, max_output_bytes: int) -> SandboxResult:
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                            env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"}, start_new_session=True, close_fds=True)
    pgid = proc.pid  # start_new_session: the child leads its own group and session
    try:
        proc.stdin.write(code)
    except OSError:  # it died before reading its code; its stderr says why
        pass
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated = timed_out = False
    deadline = start + timeout_s
    with selectors.DefaultSelector() as sel:
        for stream in out:
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        # Read until the sandbox's first process ends (in the namespaces its end kills the rest), the
        # output overflows, or the time is up. Not until EOF: without namespaces, a background child
        # may hold the pipes open long after the code is done.
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if proc.poll() is not None:
                truncated = _drain(sel, out, max_output_bytes)
                break
            if sel.get_map():
                for key, _ in sel.select(timeout=min(left, 0.05)):
                    truncated |= _pump(sel, key.fileobj, out[key.fileobj], max_output_bytes)
                if truncated:
                    break
            else:  # both streams closed, the code still runs
                try:
                    proc.wait(timeout=min(left, 0.05))
                except subprocess.TimeoutExpired:
                    pass
    killed = timed_out or truncated
    # Always kill the group, also after a clean exit: children of the code's session may be left.
    # The leader is not reaped yet (no wait before this), so its pid cannot have been reused.
    _kill_group(pgid)
    try:
        status = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'ed processes do not linger
        status = None
    for stream in out:
        stream.close()
    stdout = out[proc.stdout].decode("utf-8", "replace")
    stderr = out[proc.stderr].decode("utf-8", "replace")
    duration = time.monotonic() - start
    exit_status = None if killed else (128 - status if status is not None and status < 0 else status)
    if timed_out:
        error = "timeout"
    elif truncated:
        error = "output_limit"
        stderr += f"\n[output cut at {max_output_bytes} bytes; the process was stopped]"
    elif exit_status == SETUP_FAILED and "sandbox setup:" in stderr:
        error = "setup"
    elif exit_status == 0:
        error = None
    elif "MemoryError" in stderr[-2000:]:
        error = "memory"
    elif exit_status is not None and exit_status > 128:
        error = "signal"
    else:
        error = "exit"
    return SandboxResult(stdout, stderr, exit_status, timed_out, killed, truncated, error, duration)


def _pump(sel: selectors.BaseSelector, stream, buf: bytearray, limit: int) -> bool:
    """Append what `stream` has to `buf`, up to `limit` bytes (unregister it at EOF); True when output was cut."""
    try:
        chunk = os.read(stream.fileno(), _READ_CHUNK)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(stream)
        return False
    room = limit - len(buf)
    buf += chunk[: max(room, 0)]
    return len(chunk) > room


def _drain(sel: selectors.BaseSelector, out: dict, limit: int) -> bool:
    """After the first process ended: read what is already in the pipes; True if that cut the output."""
    for key in list(sel.get_map().values()):
        while key.fileobj in sel.get_map():
            before = len(out[key.fileobj])
            if _pump(sel, key.fileobj, out[key.fileobj], limit):
                return True
            if len(out[key.fileobj]) == before:
                break
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
