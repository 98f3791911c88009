"""What runs a sandboxed program: its limits, the warm runner's bwrap command line and the trusted launcher.

Guarantee: :func:`bwrap_prefix` starts a pool thread's runner with new PID, network, IPC, UTS and cgroup
namespaces (and a user namespace when not root), no network, a read-only root made of only what the
interpreter needs, the thread's program dir read-only at ``/sandbox`` and an empty environment; the runner
(:mod:`ckpteval.jobs.eval.sandbox.runner`) gives each program namespaces, a ``/proc`` and a capped ``/tmp`` of
its own, and :data:`LAUNCH` then sets the rlimits of :class:`Limits`, a fresh unprivileged uid per program when
run as root, and leaves no capability when the program's first line runs (it checks, and refuses to run the
program otherwise).

Limits: this module only builds argv and the launcher's source; the namespaces per program, the deadline,
the output cap, the memory cgroup and the killing are the caller's (:mod:`ckpteval.jobs.eval.sandbox.spawn`,
:mod:`ckpteval.jobs.eval.sandbox.core`). Programs get the base interpreter's standard library only (``-I -S``).
The CPU limit is per process. Without bwrap (``rlimits-only``) :data:`LAUNCHER` sets the same rlimits but
mounts nothing and isolates nothing.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# root only: every program runs as a fresh unprivileged uid (RLIMIT_NPROC counts per uid, so a fork bomb's
# processes, still being torn down, never count against the next program): base + 65536 * (pid % 10000) + n
SANDBOX_UID_BASE = 200_000
UIDS_PER_PROCESS = 65_536
ENV_LABEL = "CKPTEVAL_SANDBOX"  # set in every sandboxed process's environment: who started it
PROGRAM = "/sandbox/main.py"
READY_FD = 3  # the launcher's "up" pipe: the spawner puts it at this fd in every program's first process
# -I: no environment, no user site, no script dir on sys.path; -S: no site-packages (and none of their
# .pth start-up hooks): programs get the standard library only, and start faster.
INTERPRETER_FLAGS = ("-I", "-S")

# Trusted code that becomes the program's process (forked by the warm runner in bwrap mode, a plain subprocess in
# rlimits-only mode): launch(cpu_s, memory_bytes, file_bytes, nproc, nofile, uid, ready_fd, program, sandboxed)
# sets the limits, drops root (or, in a user namespace, the capabilities it holds there), checks that none is
# left (sandboxed), reports "up" on ready_fd, then runs the program as __main__ in this interpreter (compiled as
# UTF-8; no runpy: its imports cost more than the sandbox does). Only C modules: posix, not os; _ctypes, not
# ctypes (their imports cost a third of an interpreter's start-up; the runner's program never pays them).
LAUNCH = r"""
import posix, resource, sys
def libc_function(name, types={}):
    if not types:  # once: three tiny declarations instead of importing ctypes
        import _ctypes
        class Int(_ctypes._SimpleCData):
            _type_ = "i"
        class Func(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = Int
        class Libc:
            _handle = _ctypes.dlopen(None, 0)
        types.update(func=Func, libc=Libc, errno=_ctypes.get_errno)
    function = types["func"]((name, types["libc"]))
    def call(*args):
        if (result := function(*args)) < 0:
            raise OSError(types["errno"](), "%s failed" % name)
        return result
    return call
KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 311}.get(posix.uname().machine)  # no libc wrapper
def own_user_namespace():  # a program's: its own user keyrings, no user namespace inside it, no inherited keys
    ids = posix.getuid(), posix.getgid()
    libc_function("prctl")(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE again (a uid change clears it): its /proc/self its own
    libc_function("unshare")(0x10000000)  # CLONE_NEWUSER: the kernel keeps a uid's keyrings per user namespace
    for name, line in (("/proc/self/setgroups", b"deny"), ("/proc/self/uid_map", b"%d %d 1" % (ids[0], ids[0])),
                       ("/proc/self/gid_map", b"%d %d 1" % (ids[1], ids[1])),
                       ("/proc/sys/user/max_user_namespaces", b"0")):  # none nested: no mounts of its own
        fd = posix.open(name, posix.O_WRONLY)
        try:
            posix.write(fd, line)
        finally:
            posix.close(fd)
    if KEYCTL is not None:  # KEYCTL_JOIN_SESSION_KEYRING, anonymous: not the worker's session keyring
        libc_function("syscall")(KEYCTL, 1, None)
def clear_keys():  # in the init that made the program's user namespace, once the program ended: every keyring the
    if KEYCTL is None:  # program's uid reaches there emptied, its keys gone at once (the init, a zombie until the
        return  # runner's next message, holds the namespace and its keyrings until then)
    keyctl = libc_function("syscall")
    rings = [-3, -4, -5]  # session, user, user-session
    try:
        rings.insert(0, keyctl(KEYCTL, 22, -1, -3))  # KEYCTL_GET_PERSISTENT: the uid's persistent keyring
    except OSError:
        pass
    for ring in rings:
        try:
            keyctl(KEYCTL, 7, ring)  # KEYCTL_CLEAR
        except OSError:
            pass
def launch(cpu, mem, fsize, nproc, nofile, uid, ready, program, sandboxed):
    if sandboxed:  # the warm runner's program (its namespaces, /proc and /tmp are set up by its init)
        try:
            posix.setsid()  # its own process group: kill(0, ...) must not reach its init or the runner
            libc_function("prctl")(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as an exec'd process is (its init is not)
        except OSError as e:
            sys.exit("ckpteval launcher: cannot leave the init's session (%s, errno %d)" % (e.strerror, e.errno))
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                            (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))
    if uid >= 0 and posix.getuid() == 0:
        posix.setgroups([]); posix.setgid(uid); posix.setuid(uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if sandboxed:  # in a user namespace of its own (root: made here, as the fresh uid): give up its capabilities
        try:
            if uid >= 0:
                own_user_namespace()
            libc_function("prctl")(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
            header = (0x20080522).to_bytes(4, sys.byteorder) + bytes(4)  # _LINUX_CAPABILITY_VERSION_3, this process
            libc_function("capset")(header, bytes(24))  # permitted, effective, inheritable: all 0
        except OSError as e:
            sys.exit("ckpteval launcher: cannot isolate the program (%s, errno %d)" % (e.strerror, e.errno))
    if sandboxed:  # the program must hold no capability
        with open("/proc/self/status") as status:
            caps = [line.split()[1] for line in status if line.startswith(("CapEff:", "CapPrm:"))]
        if any(int(c, 16) for c in caps):
            sys.exit("ckpteval launcher: the program would keep capabilities %s" % caps)
    posix.write(ready, b"R"); posix.close(ready)
    sys.argv = [program]
    sys.path.insert(0, program.rpartition("/")[0])
    with open(program, "rb") as f:
        code = compile(f.read(), program, "exec")
    g = sys.modules["__main__"].__dict__
    b = g["__builtins__"]
    g.clear()  # the program's globals: __main__'s, emptied of the launcher's names
    g.update(__name__="__main__", __file__=program, __builtins__=b)
    exec(code, g)
"""
# The rlimits-only mode's program process: ``python -I -S -c LAUNCHER <the launch arguments>``.
LAUNCHER = LAUNCH + "launch(*(int(a) for a in sys.argv[1:8]), sys.argv[8], 0)\n"



@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_s: float = 10.0
    """Wall-clock deadline, enforced from outside (the whole sandbox is killed)."""
    cpu_s: int = 10
    """RLIMIT_CPU per process (SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 1024
    """RLIMIT_AS per process, MiB (Python raises MemoryError)."""
    file_mb: int = 16
    """RLIMIT_FSIZE (largest file) and the size of the private /tmp, MiB."""
    nproc: int = 32
    """RLIMIT_NPROC: processes (and threads) of the sandbox's uid (not enforced for root, see module doc)."""
    nofile: int = 64
    """RLIMIT_NOFILE: open file descriptors."""
    tmp_inodes: int = 4096
    """Files, dirs and links the private /tmp may hold (tmpfs ``nr_inodes``; bwrap mode only)."""
    output_bytes: int = 1 << 20
    """stdout and stderr are each kept up to this many bytes; more kills the program (``crashed``)."""

    def __post_init__(self) -> None:
        if not (self.wall_s > 0 and self.wall_s < float("inf")):
            raise ValueError(f"sandbox wall_s must be a positive number of seconds, got {self.wall_s}")
        for key in ("cpu_s", "memory_mb", "file_mb", "nproc", "nofile", "tmp_inodes", "output_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"sandbox {key} must be >= 1, got {getattr(self, key)}")



@functools.cache
def interpreter() -> tuple[str, str]:
    """The base interpreter (not a venv's wrapper) and its installation prefix."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


@functools.cache
def _root_binds(prefix: str) -> tuple[str, ...]:
    """bwrap arguments for the read-only root: /usr, the top-level links/dirs into it, the prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if not (prefix + "/").startswith(("/usr/", "/bin/", "/lib")):
        parts = Path(prefix).parts[1:]
        for i in range(1, len(parts)):  # parents created world-traversable (e.g. /root is 0700)
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


@functools.cache
def _dev() -> tuple[str, ...]:
    """A minimal read-only /dev: the harmless character devices and the fd links (not bwrap's --dev, whose
    devpts mount makes a later tmpfs mount fail in a user namespace, and whose /dev/shm is writable there)."""
    args = ["--perms", "0755", "--dir", "/dev"]
    for dev in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    return (*args, "--symlink", "/proc/self/fd", "/dev/fd")


def bwrap_prefix(box_dir: str, label: str, as_root: bool, info_fd: int) -> list[str]:
    """The bwrap command line, up to the command, of a pool thread's warm runner: the sandbox's namespaces,
    read-only root and environment; ``box_dir`` (a host dir holding the current program only) read-only at
    /sandbox; the runner is the namespace's PID 1 (``--as-pid-1``) and bwrap writes its host pid to
    ``info_fd`` (the parts that depend on the node only are computed once per process)."""
    # root: no user namespace (uid 0 in one is still uid 0 to RLIMIT_NPROC; the launcher drops to a
    # real unprivileged uid instead); others: --unshare-all, whose user namespace they need.
    unshare = (["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
               if as_root else ["--unshare-all", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"])  # the
    # runner's, for each program's namespaces, mounts and loopback; every program's launcher drops them all
    return [
        "bwrap", *unshare, "--die-with-parent", "--new-session", "--as-pid-1", "--info-fd", str(info_fd),
        *_root_binds(interpreter()[1]),
        "--proc", "/proc", *_dev(),
        "--dir", "/tmp",  # a mount point only: each program's init mounts its capped tmpfs there
        "--ro-bind", box_dir, PROGRAM.rpartition("/")[0],
        "--remount-ro", "/",  # in a user namespace the root tmpfs is the program's to write, uncapped
        "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/tmp", "--setenv", ENV_LABEL, label,
    ]


def launcher_args(limits: Limits, uid: int, ready_fd: int, program: str) -> list[str]:
    """The arguments of ``launch`` but the last (see :data:`LAUNCH`), as strings."""
    return [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20), str(limits.nproc),
            str(limits.nofile), str(uid), str(ready_fd), program]
