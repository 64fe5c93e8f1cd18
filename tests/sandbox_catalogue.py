"""The hostile catalogue: model-like code that tries to escape, exhaust or outlive the python tool's sandbox.

`python sandbox_catalogue.py <backend> <case>` runs one case through `postrl.agents.tools.tools.run_sandboxed`
(backend local, or sandbox_fusion through tests/sandbox_fusion_server.py on 127.0.0.1) and exits 0 when
it held: the call returned a result, nothing outside changed, and nothing of the run is left running.
test_sandbox.py starts each case as PID 1 of a PID namespace of its own (`unshare --pid --fork
--mount-proc`), so that a regression that falls open (kill(-1), a fork bomb) takes down that case only;
the runner refuses to run anywhere else.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from postrl.agents.tools.tools import run_sandboxed

SMALL = dict(timeout_s=10.0, memory_mb=256, max_processes=8, max_output_bytes=4096)
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def infinite_loop(run):
    res = run("while True:\n    pass", timeout_s=1.0)
    assert res.error == "timeout" and res.timed_out and res.exit_status is None, res


@case
def fork_bomb(run):
    res = run("import os\nwhile True:\n    os.fork()", timeout_s=2.0, max_processes=8)
    assert res.error in ("exit", "timeout"), res
    if res.error == "exit":
        assert "BlockingIOError" in res.stderr or "Resource temporarily unavailable" in res.stderr, res


@case
def memory_bomb(run):
    res = run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))", memory_mb=200)
    assert res.error == "memory" and res.exit_status == 1 and "MemoryError" in res.stderr, res


@case
def huge_output(run):
    res = run("while True:\n    print('x' * 1000)", max_output_bytes=5000)
    assert res.error == "output_limit" and res.truncated and res.killed, res
    assert len(res.stdout) == 5000 and set(res.stdout) <= {"x", "\n"}


@case
def large_file(run):
    res = run("open('big', 'wb').write(b'x' * (32 * 2**20))", max_file_mb=1)  # past the remote default (16) too
    assert res.error == "exit" and "File too large" in res.stderr, res


@case
def write_outside(run):
    ours = Path(tempfile.mkdtemp(dir=Path(__file__).parent, prefix="postrl-escape-"))  # outside /tmp: only read-only stops it
    os.chmod(ours, 0o777)
    shared = Path("/tmp") / f"postrl-escape-{random.getrandbits(64):x}"  # world-writable /tmp
    try:
        code = (f"for p in ({str(ours / 'x')!r}, {str(shared)!r}):\n    try:\n        open(p, 'w').write('pwned')\n"
                "        print('wrote', p)\n    except OSError as e:\n        print('refused', p, e.strerror)\n")
        res = run(code)
        assert res.error is None, res
        assert f"refused {ours / 'x'}" in res.stdout and f"wrote {shared}" in res.stdout  # its own private /tmp ...
        assert list(ours.iterdir()) == [] and not shared.exists()  # ... which vanished with it
    finally:
        shutil.rmtree(ours)


@case
def runs_unprivileged(run):
    res = run("import os\nprint(os.getuid(), os.geteuid())\nprint(open('/proc/self/status').read())")
    assert res.error is None, res
    uid, euid = map(int, res.stdout.split("\n")[0].split())
    caps = {line.split(":")[0]: int(line.split()[1], 16) for line in res.stdout.splitlines() if line.startswith("Cap")}
    assert (uid, euid) != (0, 0) or caps["CapEff"] == caps["CapBnd"] == 0, res.stdout  # no root's rights
    assert caps["CapEff"] == 0, caps


@case
def homes_hidden(run):
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.executable)}
    code = ("import os, json\nfor d in ('/root', os.path.expanduser('~')):\n    try:\n        print(json.dumps([d, os.listdir(d)]))\n"
            "    except OSError:\n        print(json.dumps([d, None]))\n").replace("os.path.expanduser('~')", repr(os.path.expanduser("~")))
    res = run(code)
    assert res.error is None, res
    for line in res.stdout.splitlines():  # empty, but for the way to the interpreter (e.g. /root/.pyenv), bound back
        d, entries = json.loads(line)
        if d == "/":  # HOME=/: no home directory to hide
            continue
        way_in = {Path(p).relative_to(d).parts[0] for p in interpreter if p.startswith(d.rstrip("/") + "/")}
        assert entries is None or set(entries) == way_in, (d, entries, way_in)


ALLOWED_TOP = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp", "var"}


@case
def sees_only_the_allowlist(run):
    """Ground truth planted where a run keeps it (a run directory in the checkout, /tmp, /var/tmp, beside the
    interpreter's venv) and a Hugging Face token in a fake HOME: the code reads none of them (not there at all),
    while ordinary code (the standard library, numpy, sympy from the interpreter's own tree) runs."""
    tag = f"postrl-gt-{random.getrandbits(48):x}"
    checkout = Path(tempfile.mkdtemp(dir=Path(__file__).parent, prefix="postrl-run-"))
    home = checkout / "home"
    planted = [checkout / "runs" / "exp" / "data" / "train.jsonl", Path("/tmp") / tag / "train.jsonl",
               Path("/var/tmp") / tag / "answers.json", home / ".cache" / "huggingface" / "token"]
    beside = Path(sys.prefix).parent / f"{tag}.jsonl"  # a venv inside the checkout: its siblings stay out
    if sys.prefix != sys.base_prefix and os.access(beside.parent, os.W_OK):
        planted.append(beside)
    old_home = os.environ.get("HOME")
    try:
        for path in planted:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text('{"ground_truth": "42"}')
            path.chmod(0o644)
        for d in {p.parent for p in planted} | {checkout}:  # world-traversable: only the sandbox stands in the way
            for a in [d, *d.parents]:
                if a in (checkout.parent, Path("/tmp"), Path("/var/tmp"), Path(sys.prefix).parent):
                    break
                a.chmod(0o755)
        os.environ["HOME"] = str(home)
        code = (f"import json, os, sys\nfor p in {[str(p) for p in planted]!r}:\n    try:\n        print('read', p, open(p).read())\n"
                "    except OSError as e:\n        print('refused', p, e.errno)\n"
                "import decimal, fractions, numpy, sympy\nprint('math', int(numpy.arange(5).sum()), sympy.simplify('2*x - x'), "
                "fractions.Fraction(decimal.Decimal('0.5')))\nprint('top', json.dumps(sorted(os.listdir('/'))))\n")
        res = run(code)
        assert res.error is None, res
        lines = res.stdout.splitlines()
        assert lines[: len(planted)] == [f"refused {p} 2" for p in planted], res.stdout  # ENOENT: not there at all
        assert lines[len(planted)] == "math 10 x 1/2", res.stdout
        interpreter = {Path(os.path.realpath(p)).parts[1] for p in (sys.prefix, sys.base_prefix, sys.executable)}
        assert set(json.loads(lines[-1].removeprefix("top "))) <= ALLOWED_TOP | interpreter, lines[-1]
    finally:
        if old_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old_home
        shutil.rmtree(checkout)
        shutil.rmtree(Path("/tmp") / tag, ignore_errors=True)
        shutil.rmtree(Path("/var/tmp") / tag, ignore_errors=True)
        beside.unlink(missing_ok=True)


@case
def closes_its_output(run):
    res = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.5)\nraise SystemExit(3)")
    assert (res.error, res.exit_status, res.timed_out) == ("exit", 3, False), res
    res = run("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", timeout_s=1.0)
    assert res.error == "timeout", res


@case
def network(run):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {server.getsockname()[1]}))\nprint('connected')"
        res = run(code)
        assert res.error == "exit" and "connected" not in res.stdout and "Error" in res.stderr, res
        try:
            server.accept()
            raise AssertionError("the sandbox reached a loopback server")
        except socket.timeout:
            pass


@case
def kills_its_parent(run):
    res = run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')")
    assert res.error is not None or res.stdout == "still here\n", res  # the kill failed, or hit only the sandbox's init


@case
def kills_every_process(run):
    res = run("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('sent')")
    assert res.error in (None, "exit", "signal"), res


@case
def daemon(run):
    marker = f"{50 + random.random() * 9:.9f}"  # /bin/sleep's argument doubles as a unique tag
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.closerange(0, 3)\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('daemon started')\n")
    res = run(code)
    assert res.stdout == "daemon started\n" and res.error is None, res



def _unix_listeners(stack):
    """A stream and a datagram Unix socket in /run (a daemon's place, as root) and /tmp, and an abstract one."""
    tag = f"postrl-host-{random.getrandbits(48):x}"
    dirs = [d for d in ("/run", f"/run/user/{os.getuid()}", "/tmp") if os.path.isdir(d) and os.access(d, os.W_OK)]
    assert "/tmp" in dirs and ("/run" in dirs or os.getuid() != 0), dirs
    found = []
    for d in dirs:
        for kind, suffix in ((socket.SOCK_STREAM, "s"), (socket.SOCK_DGRAM, "d")):
            sock = stack.enter_context(socket.socket(socket.AF_UNIX, kind))
            path = os.path.join(d, f"{tag}.{suffix}")
            sock.bind(path)
            stack.callback(os.unlink, path)
            os.chmod(path, 0o777)  # anyone may connect: only the sandbox stands in the way
            if kind == socket.SOCK_STREAM:
                sock.listen(4)
            sock.setblocking(False)
            found.append((path, kind, sock))
    abstract = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    abstract.bind(b"\0" + tag.encode())
    abstract.listen(4)
    abstract.setblocking(False)
    found.append((b"\0" + tag.encode(), socket.SOCK_STREAM, abstract))
    return found


UNIX_ATTEMPTS = """import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for address, kind in TARGETS:
    tries = [lambda: socket.socket(socket.AF_UNIX, kind).connect(address) if kind == socket.SOCK_STREAM
             else socket.socket(socket.AF_UNIX, kind).sendto(b'hello', address),
             lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0].sendto(b'hello', address),
             lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_RAW)[0].sendto(b'hello', address)]
    for n, attempt in enumerate(tries):
        try:
            attempt()
            print('reached', address, n)
        except OSError as e:
            print('refused', n, e.errno)
fd = libc.syscall(ctypes.c_long(socket.SYS_socket if hasattr(socket, 'SYS_socket') else NR_SOCKET),
                  ctypes.c_long(socket.AF_UNIX + 2**32), ctypes.c_long(socket.SOCK_STREAM), ctypes.c_long(0))
print('raw socket', fd, ctypes.get_errno())
try:
    socket.socket(getattr(socket, 'AF_VSOCK', 40), socket.SOCK_STREAM)
    print('vsock socket')
except OSError as e:
    print('vsock', e.errno)
print('io_uring', libc.syscall(ctypes.c_long(NR_IO_URING_SETUP), ctypes.c_long(4), ctypes.c_void_p(0)), ctypes.get_errno())
"""
NR = {"x86_64": (41, 425), "aarch64": (198, 425)}  # socket, io_uring_setup


@case
def host_unix_sockets(run):
    """A host service on a Unix socket (/run, /tmp, an abstract name) gets nothing: not a connection, not a datagram.
    Nor does a VM's host (AF_VSOCK), which the network namespace does not fence either."""
    import contextlib

    with contextlib.ExitStack() as stack:
        targets = _unix_listeners(stack)
        nr_socket, nr_uring = NR[os.uname().machine]
        code = (f"TARGETS = {[(a, int(k)) for a, k, _ in targets]!r}\nNR_SOCKET, NR_IO_URING_SETUP = {nr_socket}, {nr_uring}\n"
                + UNIX_ATTEMPTS)
        res = run(code)
        assert res.error is None, res
        lines = res.stdout.splitlines()
        assert not [line for line in lines if line.startswith("reached")], res.stdout
        assert lines.count("refused 0 13") + lines.count("refused 1 13") + lines.count("refused 2 13") == 3 * len(targets), res.stdout
        # The high bits of an int do not pass; a VM's host is not reached through vsock; no io_uring around the filter.
        assert lines[-3:] == ["raw socket -1 13", "vsock 13", "io_uring -1 1"], res.stdout
        for address, kind, sock in targets:  # nothing arrived
            with contextlib.suppress(BlockingIOError):
                got = sock.accept() if kind == socket.SOCK_STREAM else sock.recv(64)
                raise AssertionError(f"{address!r} got {got!r} from the sandbox")


@case
def socketpair_still_works(run):
    code = ("import socket, multiprocessing as mp\na, b = socket.socketpair()\na.sendall(b'ping')\nprint(b.recv(4).decode())\n"
            "c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\nc.send(b'seq')\nprint(d.recv(3).decode())\n"
            "r, w = mp.Pipe()\nw.send({'n': 42})\nprint(r.recv()['n'])\n")
    res = run(code)
    assert (res.error, res.stdout) == (None, "ping\nseq\n42\n"), res


@case
def host_ipc(run):
    """System V shared memory of the host (mode 0666) is not visible: the sandbox has an IPC namespace of its own."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = random.getrandbits(30) | 1
    shm = libc.shmget(ctypes.c_int(key), ctypes.c_size_t(4096), ctypes.c_int(0o1000 | 0o666))  # IPC_CREAT
    assert shm >= 0, os.strerror(ctypes.get_errno())
    try:
        code = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.shmget(ctypes.c_int({key}), ctypes.c_size_t(0), "
                "ctypes.c_int(0)), ctypes.get_errno())")
        res = run(code)
        assert (res.error, res.stdout) == (None, "-1 2\n"), res  # ENOENT
    finally:
        libc.shmctl(ctypes.c_int(shm), ctypes.c_int(0), None)  # IPC_RMID


@case
def mount_not_read_only(run):
    """A mount the sandbox cannot make read-only (here: one shadowed by a later mount, so that its path leads
    elsewhere) stops every run: nothing runs, and the error names the mount."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    base = Path(tempfile.mkdtemp(dir=Path(__file__).parent, prefix="postrl-mount-"))  # this case's own mount namespace
    inner = base / "inner"
    inner.mkdir()
    marker = base / "ran"
    try:
        for target in (inner, base):  # the second hides the first
            assert libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, b"size=64k") == 0, os.strerror(ctypes.get_errno())
        res = run(f"open({str(marker)!r}, 'w').write('ran')\nprint('ran')")
        assert res.error in ("isolation", "setup") and "ran\n" not in res.stdout, res
        assert f"the mount at {inner} (tmpfs) cannot be made read-only" in res.stderr, res
    finally:
        libc.umount2(str(base).encode(), 2)  # MNT_DETACH
        libc.umount2(str(inner).encode(), 2)
        assert not marker.exists()
        shutil.rmtree(base)


def _others() -> list[int]:
    """Live processes of this PID namespace other than this one (the bystander aside)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


def main(backend: str, name: str) -> int:
    if os.getpid() != 1:
        sys.stderr.write("refused: run the catalogue as PID 1 of a PID namespace of its own (unshare --pid --fork --mount-proc)\n")
        return 3
    bystander = os.fork()
    if bystander == 0:  # a process outside the sandbox that no case may reach
        time.sleep(120)
        os._exit(0)
    server = None
    settings = {"backend": backend}
    if backend == "sandbox_fusion":
        from sandbox_fusion_server import FakeSandboxFusion

        server = FakeSandboxFusion().__enter__()
        settings["url"] = server.url

    def run(code, **limits):
        limits = {**SMALL, **limits}
        return run_sandboxed(code, limits.pop("timeout_s"), {**settings, **limits})

    try:
        CASES[name](run)
    finally:
        if server is not None:
            server.__exit__()
        alive = os.waitpid(bystander, os.WNOHANG) == (0, 0)
        if alive:
            os.kill(bystander, 9)
            os.waitpid(bystander, 0)
    assert alive, "the bystander outside the sandbox was killed"
    deadline = time.monotonic() + 5  # the kernel reaps a dead namespace's processes asynchronously
    while _others() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _others(), f"left running: {[open(f'/proc/{p}/cmdline').read() for p in _others()]}"
    print(f"held: {backend} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
