"""The trusted code a sandbox thread's spawner runs (:data:`SPAWNER`): its protocol with the host, and the warm runner.

In bwrap mode the spawner is the *warm runner*: PID 1 of a bwrap sandbox started once per spawner
(:func:`ckpteval.jobs.eval.sandbox.launch.bwrap_prefix`). Per program it forks an *init* into a new PID
namespace; the init unshares the mount, IPC, UTS, network and cgroup namespaces, mounts that PID
namespace's ``/proc`` and the program's inode-capped ``/tmp``, brings the loopback up, enters a user
namespace of its own when not root, makes itself non-dumpable and forks the program's process, which runs
:data:`~ckpteval.jobs.eval.sandbox.launch.LAUNCH` (rlimits, uid or capabilities, then the program) in its
copy of the runner's interpreter: no interpreter start-up per program. The runner never reads program data:
the program's source is a file it never opens (the program's process reads ``/sandbox/main.py``), its stdin
an fd it only passes on. In rlimits-only mode the spawner exec's the launcher in a new session instead.

Protocol (a SOCK_SEQPACKET socket with the host, :class:`ckpteval.jobs.eval.sandbox.spawn.Spawner`): the
spawner says ``U`` when it is up; per program the host sends a marshalled message with four fds (stdin,
stdout, stderr, ready) and, where memory is limited by a cgroup, a fifth: the ``cgroup.procs`` of a fresh memory
cgroup for this program alone, which the program's first process joins before it does anything else (so its
pages, and pages it parks past its end, are charged there and never to the next program), the spawner answers ``P<pid>`` with a pidfd of its child (or ``E<why>``), then
``X<status>`` when the child ended (Popen's convention: -signal when killed); it keeps the child a zombie
until the next message, and a closed socket makes it kill what it started and exit.

Guarantee: the spawner and the runner never execute, parse or read program data; everything here runs
before the program's first line or outside its namespaces. Limits: the program's process is a fork of the
runner, so it shares the runner's hash seed and imported C modules (``posix``, ``_socket``, ``select``,
``fcntl``, ``marshal``, ``_signal``, ``resource``, ``_ctypes``, ``gc``), and the runner's objects stay in GC's
permanent generation (``gc.freeze``) in it.
"""

from __future__ import annotations

from ckpteval.jobs.eval.sandbox.launch import LAUNCH

# argv: the socket's fd, the cgroup's cgroup.procs (or ""), the mode. The message per program: "exec"
# (rlimits-only) (argv, env, cwd, the program's cgroup.procs or ""); "launch" (the warm runner) (launch()'s arguments but the last, /tmp's size in
# bytes, /tmp's inodes). The init exits as bwrap does: the program's status, or 128 + the signal that killed it.
SPAWNER = LAUNCH + r"""
import fcntl, marshal, select, _signal, _socket
sock = _socket.socket(fileno=int(sys.argv[1]))
posix.closerange(3, sock.fileno())  # nothing but stdio and the socket: whatever else came through bwrap
posix.closerange(sock.fileno() + 1, 1 << 16)
procs, mode = sys.argv[2], sys.argv[3]
def oom_score(value):
    try:
        fd = posix.open("/proc/self/oom_score_adj", posix.O_WRONLY)
        try:
            posix.write(fd, value)
        finally:
            posix.close(fd)
        return True
    except OSError:
        return False
def program_oom_score():  # in a program's first process, still holding the spawner's own score
    try:
        with open("/proc/self/oom_score_adj", "rb") as f:
            protected = f.read().strip() == b"-1000"
    except OSError:
        protected = False
    # a spawner the OOM killer never picks (root: itself, or the host for the runner) leaves its programs at 0;
    # else they are its first choice (1000), so a program that exhausts its cgroup is killed, not the spawner
    oom_score(b"0" if protected else b"1000")
oom_score(b"-1000")
if mode == "launch":  # PID 1 of bwrap's namespace: with SIGINT's default, a signal from a program is ignored
    _signal.signal(2, _signal.SIG_DFL)  # (Python's handler would make a KeyboardInterrupt of it)
    unshare, setns, mount, prctl = (libc_function(f) for f in ("unshare", "setns", "mount", "prctl"))
    own_pid_ns = posix.open("/proc/self/ns/pid", posix.O_RDONLY | posix.O_CLOEXEC)
    prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: die with bwrap (its --die-with-parent is lost when exec adds caps)
child = -1
program_procs = ""  # rlimits-only: the current program's own cgroup, killed with the spawner's
def join_cgroup(fds):  # in a program's first process: its own memory cgroup (the fifth fd), before anything else
    if len(fds) > 4:
        posix.write(fds[4], b"0")
        posix.close(fds[4])
    return fds[:4]
def kill_all():
    for kill in (posix.kill, posix.killpg):  # "launch": the program's init, and with it its PID namespace
        try:
            kill(child, 9) if child > 0 else None
        except OSError:
            pass
    pids = []
    for path in (procs, program_procs):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()] if path else []
        except OSError:
            pass
    for p in pids:
        if p != posix.getpid():
            try:
                posix.kill(p, 9)
            except OSError:
                pass
def become(fds):  # in a child: fds as its 0, 1, ...; nothing else open
    sock.detach()
    for i, fd in enumerate(fds):
        posix.dup2(fd, i)
    posix.closerange(len(fds), 1 << 16)
def start_exec(argv, env, cwd, group, fds):
    global program_procs
    program_procs = group
    pid = posix.fork()
    if pid:
        return pid
    try:
        fds = join_cgroup(fds)
        program_oom_score()
        posix.setsid()
        for sig in (13, 25):  # SIGPIPE, SIGXFSZ: ignored by Python, defaults again (as Popen restores them)
            _signal.signal(sig, _signal.SIG_DFL)
        become(fds)
        posix.chdir(cwd)
        posix.execve(argv[0], argv, env)
    except BaseException as e:
        posix.write(2, ("ckpteval spawner: cannot start %s: %s\n" % (argv[0], e)).encode(errors="replace"))
    finally:
        posix._exit(127)
def start_launch(args, tmp_bytes, inodes, fds):
    unshare(0x20000000)  # CLONE_NEWPID: the next child is PID 1 of a namespace of its own
    pid = posix.fork()
    if pid:
        setns(own_pid_ns, 0x20000000)  # and only that child
        return pid
    try:  # the program's init
        fds = join_cgroup(fds)
        program_oom_score()
        become(fds)
        unshare(0x00020000 | 0x08000000 | 0x04000000 | 0x40000000 | 0x02000000)  # NEWNS IPC UTS NET CGROUP
        mount(None, b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE: nothing propagates back
        mount(b"proc", b"/proc", b"proc", 14, None)  # this PID namespace's own; MS_NOSUID | MS_NODEV | MS_NOEXEC
        mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=%d,nr_inodes=%d,mode=1777" % (tmp_bytes, inodes))
        posix.chdir("/tmp")
        lo = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
        fcntl.ioctl(lo.fileno(), 0x8914, b"lo".ljust(16, b"\0") + (1).to_bytes(2, sys.byteorder) + bytes(22))
        lo.close()  # SIOCSIFFLAGS IFF_UP: the new network namespace's loopback, as bwrap brings it up
        if int(args[5]) < 0:  # not root: a user namespace of the program's own (root: the program makes its own
            own_user_namespace()  # as its fresh uid); it owns none of the namespaces above
        prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no same-uid process may ptrace the init or read its /proc
        program = posix.fork()
    except BaseException as e:
        posix.write(2, ("ckpteval runner: cannot set the program's namespaces up: %s\n" % e).encode(errors="replace"))
        posix._exit(127)
    if program == 0:
        _signal.signal(2, _signal.default_int_handler)
        return 0
    for fd in range(len(fds)):
        posix.close(fd)
    while True:
        try:
            pid, status = posix.wait()
        except OSError:
            posix._exit(127)
        if pid == program:
            if int(args[5]) < 0:
                clear_keys()
            code = posix.waitstatus_to_exitcode(status)
            posix._exit(code if code >= 0 else 128 - code)
def wait_child(pidfd):
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    poll.register(pidfd, select.POLLIN)
    while True:
        ready = dict(poll.poll())
        if pidfd in ready:
            info = posix.waitid(posix.P_PID, child, posix.WEXITED | posix.WNOWAIT)
            return info.si_status if info.si_code == posix.CLD_EXITED else -info.si_status
        if sock.fileno() in ready:  # the host sends nothing during a run: it went away
            return None
start = start_launch if mode == "launch" else start_exec
if mode == "launch":  # the runner's objects in GC's permanent generation: the program's collections, its exit's
    import gc  # included, never walk them (each walk writes their headers: a copy of every page, 1 ms a program)
    gc.freeze()
sock.send(b"U")
while True:
    try:
        msg, anc, _, _ = sock.recvmsg(1 << 20, _socket.CMSG_SPACE(5 * 4))
    except OSError:
        msg, anc = b"", []
    data = b"".join(d for level, kind, d in anc if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS)
    fds = [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    if child > 0:
        posix.waitpid(child, 0)  # the last program: a zombie until now, so its pid stayed the host's to kill
        child = -1
    if not msg:
        kill_all()
        break
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]  # above 0..3, where the child puts them
    for fd in fds:
        posix.close(fd)
    try:
        args = marshal.loads(msg)
        child = start(*args, high)
        reply = b"P%d" % child
    except (OSError, ValueError, EOFError, TypeError) as e:
        reply = ("E%s" % e).encode(errors="replace")
    if child == 0:
        break  # the program's process
    for fd in high:
        posix.close(fd)
    pidfd = posix.pidfd_open(child) if child > 0 else -1
    anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))] if pidfd >= 0 else []
    sock.sendmsg([reply], anc)
    if child > 0:
        code = wait_child(pidfd)
        posix.close(pidfd)
        if code is None:
            kill_all()
            posix.waitpid(child, 0)
            break
        sock.send(b"X%d" % code)
if child == 0:
    launch(*(int(a) for a in args[0][:7]), args[0][7], 1)
"""
