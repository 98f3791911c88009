"""What runs a sandboxed program: its limits, the bwrap command line and the trusted launcher inside it.

Guarantee: :func:`bwrap_command` + :func:`launcher_args` start a program with new PID, network, IPC and UTS
namespaces (and a user namespace when not root), no network, a read-only root made of only what the
interpreter needs, an empty environment, a private ``/tmp`` capped in bytes and inodes, the rlimits of
:class:`Limits`, a fresh unprivileged uid per program when run as root, and no capability left when the
program's first line runs (the :data:`LAUNCHER` checks it and refuses to run the program otherwise).

Limits: this module only builds argv; the deadline, the output cap, the memory cgroup and the killing are
the caller's (:mod:`ckpteval.jobs.eval.sandbox_spawn`, :mod:`ckpteval.jobs.eval.sandbox`). Programs get the
base interpreter's standard library only (``-I -S``). The CPU limit is per process. Without bwrap
(``rlimits-only``) the same launcher sets the same rlimits but mounts nothing and isolates nothing.
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
READY_FD = 3  # the launcher's "up" pipe: the spawner puts it at this fd in every sandbox's first process
# -I: no environment, no user site, no script dir on sys.path; -S: no site-packages (and none of their
# .pth start-up hooks): programs get the standard library only, and start faster.
INTERPRETER_FLAGS = ("-I", "-S")

# Runs inside the sandbox (argv: cpu_s memory_bytes file_bytes nproc nofile uid ready_fd tmp_bytes tmp_inodes
# program). Trusted code: mount the private /tmp with an inode cap (bwrap only), set the limits, drop root (or,
# in a user namespace, the one capability kept for the mount), report "up" on ready_fd, then run the program
# as __main__ in this interpreter (compiled as UTF-8; no runpy: its imports cost more than bwrap does).
LAUNCHER = r"""
import posix, resource, sys  # posix, not os: os's import costs more than bwrap
cpu, mem, fsize, nproc, nofile, uid, ready, tmp_bytes, inodes = (int(a) for a in sys.argv[1:10])
program = sys.argv[10]
if inodes > 0:  # _ctypes, not ctypes: ctypes's import costs a third of an interpreter's start-up
    import _ctypes
    class Int(_ctypes._SimpleCData):
        _type_ = "i"
    class Func(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int
    class Libc:
        _handle = _ctypes.dlopen(None, 0)
    opts = b"size=%d,nr_inodes=%d,mode=1777" % (tmp_bytes, inodes)
    if Func(("mount", Libc))(b"tmpfs", b"/tmp", b"tmpfs", 6, opts) != 0:  # MS_NOSUID | MS_NODEV
        sys.exit("ckpteval launcher: cannot mount the private /tmp (errno %d)" % _ctypes.get_errno())
    posix.chdir("/tmp")
    if uid < 0:  # in a user namespace: give up CAP_SYS_ADMIN (kept by bwrap for the mount)
        Func(("prctl", Libc))(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
        class Header(_ctypes.Array):
            _type_, _length_ = Int, 2
        class Data(_ctypes.Array):
            _type_, _length_ = Int, 6
        if Func(("capset", Libc))(Header(0x20080522, 0), Data()) != 0:  # _LINUX_CAPABILITY_VERSION_3, all 0
            sys.exit("ckpteval launcher: cannot drop capabilities (errno %d)" % _ctypes.get_errno())
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
if uid >= 0 and posix.getuid() == 0:
    posix.setgroups([]); posix.setgid(uid); posix.setuid(uid)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
if inodes > 0:  # bwrap: the program must hold no capability
    with open("/proc/self/status") as status:
        caps = [line.split()[1] for line in status if line.startswith(("CapEff:", "CapPrm:"))]
    if any(int(c, 16) for c in caps):
        sys.exit("ckpteval launcher: the program would keep capabilities %s" % caps)
posix.write(ready, b"R"); posix.close(ready)
sys.argv = [program]
sys.path.insert(0, program.rpartition("/")[0])
def run(path, g):
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    b = g["__builtins__"]
    g.clear()  # the program's globals: __main__'s, emptied of the launcher's names
    g.update(__name__="__main__", __file__=path, __builtins__=b)
    exec(code, g)
run(program, sys.modules["__main__"].__dict__)
"""



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


def bwrap_command(program_file: str, label: str, as_root: bool) -> list[str]:
    """The full bwrap command line that runs ``program_file`` (a host path) under the launcher (the parts that
    depend on the node only are computed once per process)."""
    exe, prefix = interpreter()
    # root: no user namespace (uid 0 in one is still uid 0 to RLIMIT_NPROC; the launcher drops to a
    # real unprivileged uid instead); others: --unshare-all, whose user namespace they need.
    unshare = (["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
               if as_root else ["--unshare-all", "--cap-add", "CAP_SYS_ADMIN"])  # the launcher drops it
    return [
        "bwrap", *unshare, "--die-with-parent", "--new-session",
        *_root_binds(prefix),
        "--proc", "/proc", *_dev(),
        "--dir", "/tmp",  # a mount point only: the launcher mounts the capped tmpfs there (a bwrap --tmpfs: 0.8 ms)
        "--perms", "0755", "--dir", "/sandbox", "--ro-bind", program_file, PROGRAM,
        "--remount-ro", "/",  # in a user namespace the root tmpfs is the program's to write, uncapped
        "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/tmp", "--setenv", ENV_LABEL, label,
        exe, *INTERPRETER_FLAGS, "-c", LAUNCHER,
    ]


def launcher_args(limits: Limits, uid: int, ready_fd: int, program: str, bwrap: bool) -> list[str]:
    """The launcher's argv (see :data:`LAUNCHER`); the inode-capped /tmp is mounted under bwrap only."""
    inodes = limits.tmp_inodes if bwrap else 0
    return [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20), str(limits.nproc),
            str(limits.nofile), str(uid), str(ready_fd), str(limits.file_mb << 20), str(inodes),
            program]
