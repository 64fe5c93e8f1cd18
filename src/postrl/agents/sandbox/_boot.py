"""The sandbox's first process: sets the fences up, then runs the model's code as its child.

Run by `sandbox.run_python` as `python -I _boot.py <settings JSON>` (inside `unshare` where the
kernel allows it), with the model's code on stdin. It imports nothing from postrl (it runs under
`-I`, before any fence exists, and must stay small enough to read in one sitting).

Inside the namespaces (`isolate: true`) it is PID 1 of a new PID namespace and root of a new mount
namespace. It then, in order:
1. makes every mount private and read-only (so nothing outside can be written, whoever runs); a mount
   that refuses (other than the kernel's interfaces: /proc, /sys, KERNEL_FS) stops the run, nothing runs,
2. builds the code's own root, a fresh tmpfs, and pivots into it (pivot_root, the old root detached, so no
   path, descriptor or /proc link leads back): it holds only an allowlist, read-only, at the same paths:
   the system's programs and libraries (SYSTEM), a few files of /etc (ETC), harmless devices (DEVICES), the
   namespace's /proc, and the interpreter's own trees (its venv, its base prefix, wherever they lie);
   fresh size-limited tmpfs on /tmp, /var/tmp, /dev/shm and the working directory are the code's only
   writable places (gone with the namespace). The project's data, checkpoints, logs, caches and every home
   directory are simply not there. An allowlist rather than hiding what is known to be private: a directory
   nobody listed (a new data mount, /work, /srv) stays out by default,
3. checks the result (every mount read-only but the scratch space) and stops the run if it is not,
4. forks the code's process: drops to uid/gid 65534 (real root) or drops every capability (user
   namespace), sets no_new_privs, installs the seccomp filter the caller built (`sandbox.seccomp_program`:
   no socket(AF_UNIX / AF_VSOCK), so no filesystem or abstract Unix socket and no VM host is reached;
   socketpair for streams keeps working) and the rlimits, and execs `python -I main.py`,
5. waits for it as init and exits with its status. When PID 1 exits the kernel kills every process
   left in the namespace, so a daemonised child cannot outlive the call.
Without the namespaces (`isolate: false`) it skips steps 1-3; step 5 then only keeps a process
between the code and the caller (killing the code's parent kills this one, not the trainer).

A setup failure exits with SETUP_FAILED and one line on stderr starting with "sandbox setup:".
"""

import ctypes
import json
import os
import re
import resource
import sys

SETUP_FAILED = 125
NOBODY = 65534
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_NOSYMFOLLOW, MS_PRIVATE, MS_RELATIME = 256, 1 << 18, 1 << 21
PR_CAPBSET_DROP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 24, 22, 38
SECCOMP_MODE_FILTER = 2
# Kernel interfaces that hold no user files: a refused read-only remount of these is not a way out.
# What the code sees of the machine besides the interpreter's own trees and scratch space: system programs and
# libraries, the few files of /etc that the C library and Python read, the harmless devices. Nothing else is there.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group", "nsswitch.conf", "hosts", "os-release",
       "alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
MNT_DETACH = 2
KERNEL_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
                       "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "nsfs"})

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message):
    sys.stderr.write(f"sandbox setup: {message}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def _unescape(raw):
    """A mountinfo field as a path: the kernel writes space, tab, newline and backslash as \\ooo octal."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), raw))


def _mount_points():
    """(mount point, file system type) of every mount of this namespace, in mount order."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields, _, rest = line.partition(b" - ")
            points.append((_unescape(fields.split()[4]), os.fsdecode(rest.split()[0]) if rest else ""))
    return points


def _remount_read_only():
    """Every mount read-only, or nothing runs: a mount left writable is a way out. Exempt only the kernel's
    interfaces (/proc, /sys and the pseudo file systems of KERNEL_FS), which hold no user files; the code
    meets them without privileges (uid 65534 or no capabilities)."""
    for point, fstype in _mount_points():
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(point))
        except OSError as exc:
            if point != "/" and (fstype in KERNEL_FS or point.startswith(("/proc/", "/sys/")) or point in ("/proc", "/sys")):
                continue
            raise OSError(exc.errno, f"the mount at {point} ({fstype or 'unknown type'}) cannot be made read-only "
                                     f"({os.strerror(exc.errno or 0)}), so the code could write there; nothing runs. "
                                     f"Fix: unmount it, or make it read-only before starting postrl") from None


def _under(path, directory):
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _locked_flags(path):
    """The flags of the mount at `path` that a bind remount must keep (in a user namespace, dropping one is EPERM)."""
    keep = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
            os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME,
            getattr(os, "ST_NOSYMFOLLOW", 8192): MS_NOSYMFOLLOW}
    have = os.statvfs(path).f_flag
    return sum(ms for st, ms in keep.items() if have & st)


def _set_limits(s):
    mb = 1024 * 1024
    limits = [
        (resource.RLIMIT_CPU, s["cpu_s"]),
        (resource.RLIMIT_AS, s["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, s["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, s["open_files"]),
        (resource.RLIMIT_NPROC, s["nproc"]),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _place(root, path, writable=None):
    """Make `path` of the old tree appear at the same path under `root`: a symbolic link is copied, a directory or
    file is bound (recursively, read-only), `writable` (tmpfs options) mounts a fresh tmpfs there instead."""
    target = root + path
    if writable is not None:
        os.makedirs(target, exist_ok=True)
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, writable)
    elif os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(path), target)
    else:
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "x").close()
        _mount(path, target, None, MS_BIND | MS_REC)
        if not path.startswith("/proc"):  # a kernel interface keeps its own flags; a device stays one
            nodev = 0 if path.startswith("/dev/") else MS_NODEV
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | nodev | _locked_flags(target))


def _isolate(s):
    """Steps 1-3 of the module docstring, as root of the new mount namespace."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _remount_read_only()  # first: every bind below is then a clone of a read-only mount
    os.umask(0o022)  # the new root's directories: traversable by uid 65534
    size = f"size={s['tmpfs_mb']}m,nr_inodes=4096"
    owner = f",uid={NOBODY},gid={NOBODY}" if s["drop_to_nobody"] else ""
    places = {d: f"mode=1777,{size}" for d in SCRATCH}  # private scratch space
    places[s["workdir"]] = f"mode=0700,{size}{owner}"
    places.update({p: None for p in SYSTEM + tuple("/etc/" + e for e in ETC) + tuple("/dev/" + d for d in DEVICES)
                   if os.path.lexists(p)})  # fmt: skip
    places["/proc"] = None  # the PID namespace's own (unshare --mount-proc)
    interpreter = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                                 os.path.dirname(s["python"]), os.path.dirname(os.path.realpath(s["python"])))}
    for p in sorted(interpreter):  # the outermost of each tree, unless a directory above already brings it
        if p != "/" and not any(_under(p, q) for q in interpreter | set(places) if q != p and places.get(q) is None):
            places[p] = None
    root = s["workdir"]  # the new root is a fresh tmpfs over the working directory (made by the caller) ...
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=1024")
    for path in sorted(places, key=lambda p: p.count("/")):  # parents before what is mounted inside them
        _place(root, path, places[path])
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)  # ... which replaces / (pivot_root(2): new and old root the same, then the old one detached)
    pivot = getattr(_libc, "pivot_root", None)  # glibc >= 2.2.5 and musl have it
    if pivot is None:
        raise OSError(38, "the C library has no pivot_root, so the sandbox cannot have a root of its own")
    if pivot(b".", b".") != 0 or _libc.umount2(b".", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root to the sandbox's own root: {os.strerror(err)}")
    os.chdir("/")
    _check_fence({p for p, options in places.items() if options is not None})


def _check_fence(writable):
    """Fail closed: after the pivot, every mount is one this file placed, read-only unless it is scratch space."""
    for point, fstype in _mount_points():
        if point == "/proc" or point.startswith("/proc/") or point in writable:
            continue
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise OSError(1, f"the mount at {point} ({fstype}) is writable inside the sandbox; nothing runs")


def _drop_privileges(s):
    if s["drop_to_nobody"]:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # from real root to an ordinary uid: every capability goes with it
    else:
        cap = 0  # an ordinary user has no CAP_SETPCAP and stops at once: it has nothing to drop
        while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # the exec'd code gets none
            cap += 1
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_filter(program):
    """Load the seccomp program (sandbox.seccomp_program, classic BPF, 8 bytes an instruction) into this
    process; every process the code starts inherits it, and nothing can remove it."""
    if not program or len(program) % 8 or len(program) // 8 > 4096:
        raise OSError(22, f"a seccomp program of {len(program)} bytes is not one")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    ok = _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                     ctypes.c_ulong(0), ctypes.c_ulong(0))
    if ok != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot install the seccomp filter: {os.strerror(err)}")


def _exec_code(s):
    _set_limits(s)
    os.chdir(s["workdir"])
    os.execve(s["python"], [s["python"], "-I", "main.py"], s["env"])


def main():
    s = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the code gets an empty stdin
    try:
        if s["isolate"]:
            _isolate(s)
        main_py = os.path.join(s["workdir"], "main.py")
        with open(main_py, "wb") as f:
            f.write(code)
        if s["drop_to_nobody"]:
            os.chown(main_py, NOBODY, NOBODY)
    except OSError as exc:
        _fail(str(exc))
    pid = os.fork()
    if pid == 0:
        try:
            _drop_privileges(s)
            if s["isolate"]:  # after no_new_privs (which an unprivileged filter needs), before the code
                _install_filter(bytes.fromhex(s["seccomp"]))
            _exec_code(s)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into main()
            sys.stderr.write(f"sandbox setup: {exc}\n")
            sys.stderr.flush()
        os._exit(SETUP_FAILED)
    # PID 1 (or, without namespaces, a buffer between the code and the caller, so that killing its
    # parent kills this process and not the trainer): reap orphans until the code's process ends.
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        if done == pid:
            if os.WIFSIGNALED(status):
                os._exit(128 + os.WTERMSIG(status))
            os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
