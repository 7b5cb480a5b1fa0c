"""A warm interpreter for many runs of one Python program, each in a root of its own (runtime/warm.py
starts it and hands it the runs).

Shipped into a run and started there as `python3 zygote.py LAYERS [PROGRAM]`, with REAPER and ROOT_LIB
beside it; it imports nothing of image_builder and keeps to syntax Python 3.6 parses (it refuses to serve
before 3.8, which lacks os.posix_spawn). It is a run like any other (a fresh root over the instance's
layers, its own pid, mount, ipc and network namespaces, root of a user namespace that owns nothing of
the host), and the instance's layers are bound read-only at LAYERS. It compiles PROGRAM (without one, each job
names its own, compiled in the job as `python3 FILE` would: the interpreter's start is what is saved);
a PROGRAM that defines `zygote_job` at its top level (a grader's own file: graders/assert_sides.py) has
that top level run here, once, as module __ib_program__, and each job calls its zygote_job() instead of
running the file: the job's classes and functions are not made anew each time (MBPP, 2 workers: 7.9
-> 7.6 ms of the machine's CPU a case). Then it makes itself pid 1 of a pid namespace of its own
(own_pid_namespace); then, per job, it makes a new pid namespace, starts REAPER there as its pid 1
(image-builder-init `reap`: a static program that reaps what the job leaves it; not dumpable, no
capabilities), and forks the job's process into it (pid 2, as a command under an init), which:
  - enters its root with ROOT_LIB (native/zygote_root.c), one call that does what the next three say:
    built in Python, a ctypes call a mount, it cost a job 1.4 ms and 250 copy-on-write faults;
  - takes a session of its own (a process group and a scheduler autogroup);
  - makes a new mount and ipc namespace, a tmpfs, and a new overlay root of LAYERS under it (so a
    fresh writable layer, /tmp and /dev/shm), /proc of its pid namespace with /proc/sys read-only
    (the zygote's /proc where a new one may not be mounted: the kernel backend masks /proc, and a
    masked one cannot be re-mounted from a user namespace), the zygote's /dev with a devpts of its
    own; pivots into it and detaches the rest;
  - drops into a nested user namespace that owns none of that (the mounts and /proc masks stay put);
  - reads the job's files from the job's descriptor (never the zygote: its memory holds no job's
    files or input, so no fork of it does; the control messages of earlier jobs (argv, paths,
    limits) may linger in it: never put a job's data in argv), writes them (regular files only, as
    init.c writes a run's), takes the job's stdio, workdir and limits: ROOT_LIB again, one call
    (ib_enter_job; in Python it cost another 0.3-0.6 ms and 60-130 faults a job);
  - runs PROGRAM as __main__ with the job's argv (as the interpreter would: an absolute __file__,
    sys.path[0] its folder, an uncaught exception through sys.excepthook without this file's frames,
    SystemExit's status).
  The zygote waits for the job's process (its child: the exit status, the peak memory), then kills
  REAPER, which takes every other process of the job with it, before it starts the next. A Python
  fork as pid 1 cost each job a second copy of the zygote's page tables, its copy-on-write faults and
  its teardown: 1457 -> 1077 faults a case, 173 -> 199 MBPP cases/s (2 workers, 6 rounds A/B).
  The loop between two forks (receive the job, the pid keeper, the job's pid namespace and REAPER, the
  waits, the checks below, the answer) is ROOT_LIB's too (ib_next, ib_wait): in Python it wrote over
  about 200 pages of the zygote's heap a job, a copy-on-write fault each while the job lived (MBPP, 2
  workers, A/B over 8 rounds: 884 -> 687 faults, 9.8 -> 8.7 ms of the machine's CPU a case).

What a job shares with the zygote and so with the jobs before it: the interpreter's state as the
zygote left it (modules imported, PROGRAM compiled or its top level run, ROOT_LIB loaded, the hash
seed; its objects frozen out of the collector's reach: gc.freeze), copied on write, never written back: what a job changes in memory, the program's module and
classes included, dies with it; no job's code ever runs in the zygote, and ROOT_LIB keeps only its loop's state (what the
jobs must leave as they found it, the answer it sends), nothing a job gave it but the control message. Files: the layers, read-only; every writable file
system is the job's own. Processes: none survive a job. IPC: a namespace per job. Network: the
zygote's own namespace (lo only, offline_network), as long as no job leaves a trace in it. Sockets'
state outlives their processes (a closed connection waits a minute in TIME_WAIT; every packet, even
one refused for want of a route, counts in /proc/net/snmp): a namespace a job used let the next job
read what it left, and pass a case it could not pass alone. So after each job the zygote reads what
a job can change there (zygote_root.c net_state: the counters, and what outlives a process without a packet: unix
sockets in flight, IPv6 flow labels) and, where anything differs, makes itself a new
namespace before the next job. Nothing else of a namespace is a job's to change: its configuration
(routes, addresses, filters) takes CAP_NET_ADMIN where the job has no capability (its user namespace
is nested in the owner's), and /proc/sys, whose net files the job's uid could otherwise write as the
owner's root, is read-only in its root. A job that opens no socket (an MBPP case) so costs no
namespace: one each cost 1.5-2.7 ms of the machine's CPU a case, with its teardown (40 MBPP tasks,
2 workers, A/B over 8 rounds: 115 against 124 cases/s). What a job learns of the jobs before it from that: whether
one used the network since (the namespace's inode number), a bit a retiring zygote gives too. Scheduling: an autogroup
per job; a job can still renice the zygote's own (its /proc file is the job's user's to write), and
the zygote then serves no more jobs; so does one whose job set the times of the /proc they share.
What a job can see of the zygote: with the zygote's /proc (kernel backend), nothing of its processes
(the init hides what a job may not trace: hidepid; before, a job read the zygote's fault counter, 184
more each job, a count of the cases before it), which it cannot signal either (they have no pid in
its namespace, and pidfd_send_signal refuses a process outside it: EINVAL); its own pid 1 ignores its
signals, as a namespace's init does. Its own pids there (/proc/self) are the same every job: before
each, the run's pid keeper (init.c pid_keeper, on descriptor 3) puts the namespace's counter back to
where it was when the zygote started; without a keeper under a masked /proc the zygote does not
serve. A zygote that stops answering all the same is killed with its run (warm.py). The evaluator's
zygote is another run, in another pid namespace.

Control protocol, on descriptor 0 (a SOCK_SEQPACKET socket; descriptors with SCM_RIGHTS), what it sends
JSON, what it takes a header and marshal's format (version 4; warm.py writes it, no job ever does):
  <- {"ready": true} once, when it takes jobs
  -> the job's timeout in microseconds and the CPU it keeps to (int64s, little-endian; < 0: none), then
     {"argv": [...] (after PROGRAM), "program": path (the job's, without PROGRAM), "workdir": str,
      "memory_mb": n|null, "max_processes": n, "scratch_kb": [layer, tmp, shm]
      (each tmpfs's share of the memory: init.c's scratch_sizes)} + stdin, stdout, stderr, the
      job's files (u32 path length, path, u64 size, bytes; paths absolute)
  <- {"exit_code": n|null, "signal": n|null, "timed_out": b, "peak_memory_kb": n[, "retire": why]} or
     {"error": text} ("retire": the zygote leaves after this answer)
     (an error: the job did not start, nothing of it ran; warm.py then runs it the ordinary way)
"""

# Only C modules past ctypes (and PRELOAD): json and socket.py were the zygote's by accident, and cost its
# jobs' forks their pages (0.4 MB beyond PRELOAD's). Jobs come in marshal's format (only warm.py writes it),
# answers go in JSON written by ROOT_LIB.
import _signal as signal
import _socket as socket
import ctypes
import fcntl
import gc
import marshal
import os
import stat
import struct
import sys

NEWPID, NEWNET = 0x20000000, 0x40000000
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
PR_SET_DUMPABLE = 4
MACHINES = ("x86_64", "aarch64")  # ROOT_LIB's
REAPER = "/tmp/.ib-zygote/init"  # image-builder-init (native/init.c `reap`), shipped beside this file by warm.py
ROOT_LIB = "/tmp/.ib-zygote/root.so"  # native/zygote_root.c, shipped beside this file by warm.py
# The standard modules solutions import most (the sample's MBPP references: re, itertools, sys; CodeContests':
# sys, collections, heapq, os, math, io, bisect, copy, functools), imported once here: 6 ms a job took to
# import them, for 0.75 MB more of the zygote. (The rest is what this file needs: os, sys, io, collections,
# itertools come with the interpreter or ctypes.)
PRELOAD = ("re", "heapq", "bisect", "math", "copy", "functools")
ENTRY = "zygote_job"  # a PROGRAM that defines it has its top level run once, in the zygote (the docstring)
IB_END, IB_FORK, IB_NEXT, IB_NETWORK = range(4)  # ROOT_LIB's loop (zygote_root.c)
HEADER = 16  # a job's message starts with its timeout and its CPU, ROOT_LIB's loop's (zygote_root.c HEADER)
PROC_MASKED = False  # masks are mounted over parts of the zygote's /proc (serve tells)
ETC_MODE = 0  # the layers' /etc's mode where each job's root gets Docker's /etc/hosts (serve tells; 0: none)
WARM_UP = """import sys
class A(object):
    def f(self, x, *args, **kw):
        try:
            return [y for y in range(x) if y % 2] + list({k: v for k, v in kw.items()})
        except (ValueError, KeyError) as e:
            raise RuntimeError("%s %r" % (e, args)) from e
print(A().f(3), sys.argv, file=sys.stderr)
"""

libc = ctypes.CDLL(None, use_errno=True)
root_lib = None  # ROOT_LIB, loaded by serve
STEP = ctypes.create_string_buffer(128)  # where ROOT_LIB names a step that failed


def check(r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def root_options(layers, scratch_kb):
    """ROOT_LIB's mount options for a job's root: the overlay's, then the scratch tmpfs's, /tmp's and
    /dev/shm's. Made in the job's process, which alone reads the job's message (the zygote's loop is
    ROOT_LIB's and parses none of it); made by the zygote, its few objects would be the same pages written."""
    layer, tmp, shm = ("size=%dk,nr_inodes=%d" % (kb - kb // 8, max(16, kb // 8)) for kb in scratch_kb)
    return (ctypes.c_char_p * 4)(("lowerdir=%s,upperdir=/tmp/u,workdir=/tmp/w,userxattr" % layers).encode(),
                                 ("mode=755," + layer).encode(), ("mode=1777," + tmp).encode(),
                                 ("mode=1777," + shm).encode())


def enter_root(options, job, keep):
    """The job's root, as the runtime's init builds one (native/init.c enter_root), and its nested user
    namespace: see the docstring. One call of ROOT_LIB (native/zygote_root.c), which first closes every
    descriptor but `keep` and takes a session of its own."""
    native(root_lib.ib_enter_root(options, PROC_MASKED, ETC_MODE, job["max_processes"],
                                  (ctypes.c_int * len(keep))(*keep), len(keep), STEP, len(STEP)))


def native(error):
    """A call of ROOT_LIB's: 0, or an errno with the step that failed in STEP."""
    if error:
        raise OSError(error, "%s: %s" % (STEP.value.decode(errors="replace"), os.strerror(error)))


# Addresses that answer nobody on the internet either: documentation and reserved ranges, and 10.255.255.1,
# the one timeout tests dial (requests', urllib3's). Routed into lo, where nothing takes them, a connect
# there times out as it does with a network; every other address off the host fails at once. No name server
# is in them, so a lookup still fails at once. (native/init.c has the same list.)
SILENT_NETS = (("10.255.255.1", 32), ("240.0.0.0", 8), ("192.0.2.0", 24), ("198.51.100.0", 24),
               ("203.0.113.0", 24))
_RTM_NEWROUTE, _NLM_F_REQUEST_ACK_CREATE_EXCL = 24, 1 | 4 | 0x400 | 0x200
_RT_TABLE_MAIN, _RTPROT_STATIC, _RT_SCOPE_LINK, _RTN_UNICAST, _RTA_DST, _RTA_OIF, _LOOPBACK_IFINDEX = \
    254, 4, 253, 1, 1, 4, 1


def new_network():
    """A network namespace of the zygote's own for its jobs (offline_network)."""
    check(libc.unshare(NEWNET), "unshare the network namespace")
    offline_network()


def offline_network():
    """A run's network without the network, in a new network namespace (it has only lo, and it is down;
    tests still use 127.0.0.1): lo up, SILENT_NETS routed into it (netlink: rtnetlink, as `ip route`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
    finally:
        s.close()
    try:
        _route_silent_nets()
    except OSError:
        pass  # best effort: where a kernel refuses, those addresses fail at once like the rest


def _route_silent_nets():
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    try:
        for seq, (net, bits) in enumerate(SILENT_NETS, 1):
            body = (struct.pack("=BBBBBBBBI", socket.AF_INET, bits, 0, 0, _RT_TABLE_MAIN, _RTPROT_STATIC,
                                _RT_SCOPE_LINK, _RTN_UNICAST, 0)
                    + struct.pack("=HH4s", 8, _RTA_DST, socket.inet_aton(net))
                    + struct.pack("=HHI", 8, _RTA_OIF, _LOOPBACK_IFINDEX))
            nl.send(struct.pack("=IHHII", 16 + len(body), _RTM_NEWROUTE, _NLM_F_REQUEST_ACK_CREATE_EXCL, seq, 0)
                    + body)
            error = -struct.unpack_from("=i", nl.recv(4096), 16)[0]  # the ack: nlmsgerr's error
            if error:
                raise OSError(error, "route %s/%d into lo: %s" % (net, bits, os.strerror(error)))
    finally:
        nl.close()


def etc_mode(layers):
    """Where the layers have a directory /etc without hosts in it, its mode: each job's root gets Docker's
    /etc/hosts there, as init.c's default_hosts gives a run's (that says why). Else 0."""
    try:
        etc = os.lstat(os.path.join(layers, "etc"))
        if not stat.S_ISDIR(etc.st_mode) or os.path.lexists(os.path.join(layers, "etc", "hosts")):
            return 0
        return stat.S_IMODE(etc.st_mode)
    except OSError:
        return 0


def job_process(job, fds, failed_w, code, program):
    """pid 2: the job's stdio and files, its limits, then PROGRAM as __main__ (as `python3 PROGRAM ARGS`)."""
    try:
        native(root_lib.ib_enter_job((ctypes.c_int * 4)(*fds), failed_w, job["workdir"].encode(),
                                     job["memory_mb"] << 20 if job["memory_mb"] else 0, STEP, len(STEP)))
    except OSError as e:  # said on the job's stderr, as init.c says why a run's files cannot be written
        os.write(2, ("image-builder: the job's files, workdir or limits: %s\n" % e).encode())
        os._exit(127)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    prctl(PR_SET_DUMPABLE, 1)
    given = program if code is not None else job["program"]
    path = os.path.abspath(given)
    sys.argv = [given] + job["argv"]
    sys.path[0] = os.path.dirname(path)
    status = 0
    try:
        if code is None:  # the job's own program: read and compiled here, under its limits
            try:
                with open(path, "rb") as f:
                    code = compile(f.read(), path, "exec", dont_inherit=True)
            except OSError as e:
                sys.stderr.write("%s: can't open file %r: [Errno %d] %s\n"
                                 % (sys.executable or "python3", given, e.errno, e.strerror))
                os._exit(2)
        if isinstance(code, type(sys)):  # PROGRAM's top level ran in the zygote (program_module)
            sys.modules["__main__"] = code
            getattr(code, ENTRY)()
        else:
            module = type(sys)("__main__")
            module.__file__ = path
            module.__builtins__ = __builtins__
            sys.modules["__main__"] = module
            exec(code, module.__dict__)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == job_process.__code__.co_filename:
            tb = tb.tb_next  # the interpreter's own report starts at the program's frame
        try:
            sys.excepthook(kind, value.with_traceback(tb), tb)  # the default hook prints value's own
        except BaseException:
            pass
        status = 1
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status & 0xFF)


def program_module(code, program):
    """PROGRAM's top level, run once (a program that defines ENTRY: the docstring)."""
    module = type(sys)("__ib_program__")
    module.__file__ = os.path.abspath(program)
    module.__builtins__ = __builtins__
    exec(code, module.__dict__)
    return module


def prctl(option, value):
    libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def job_child(job, msg, layers, code, program):
    """pid 2 of the job's pid namespace (a fork of the zygote; pid 1 is REAPER): its root, then the job."""
    try:
        fds, failed_w = list(job.fds), job.failed_w
        try:
            # Its message after the header (zygote_root.c HEADER: the timeout and CPU, the zygote's to keep).
            job = marshal.loads(ctypes.string_at(ctypes.addressof(msg) + HEADER, job.msg_len))
            enter_root(root_options(layers, job["scratch_kb"]), job, [failed_w] + fds)  # closes the zygote's
        except BaseException as exc:  # nothing of the job ran: warm.py runs it the ordinary way
            os.write(failed_w, ("%s: %s" % (type(exc).__name__, exc)).encode())
            raise
        job_process(job, fds, failed_w, code, program)
    finally:
        os._exit(127)


class Job(ctypes.Structure):
    """zygote_root.c struct ib_job: what the job's process takes up (its message in the zygote's buffer)."""
    _fields_ = [("msg_len", ctypes.c_long), ("fds", ctypes.c_int * 4), ("failed_w", ctypes.c_int)]


def serve(layers, program):
    global PROC_MASKED, ETC_MODE, root_lib
    keeper = pid_keeper()  # first: nothing of this process is on descriptor 3 yet
    with open("/proc/self/mountinfo") as f:  # the kernel backend's masks
        PROC_MASKED = any(line.split()[4].startswith("/proc/") for line in f)
    ETC_MODE = etc_mode(layers)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # an image's Python without it: its jobs find that out themselves
            pass
    code = None
    if program is not None:
        with open(program, "rb") as f:
            code = compile(f.read(), program, "exec", dont_inherit=True)
        if ENTRY in code.co_names:  # it defines ENTRY at its top level
            code = program_module(code, program)
    else:  # the compiler's first use in a process sets it up: done here, not in every job that compiles its
        # program (a job's own faults before it runs `print(1)`: 566 -> 395)
        compile(WARM_UP, "<warm-up>", "exec", dont_inherit=True)
    prctl(PR_SET_DUMPABLE, 0)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    if PROC_MASKED and not (keeper and reset_pids(keeper)):
        # Its jobs would read, in their pids, how many forks the jobs before them made.
        sys.stderr.write("zygote: no pid keeper for a masked /proc (init.c pid_keeper)\n")
        sys.exit(3)
    try:
        os.chmod(REAPER, 0o500)
        root_lib = ctypes.CDLL(ROOT_LIB)
        root_lib.ib_enter_root.argtypes = (ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int, ctypes.c_long,
                                           ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
        root_lib.ib_enter_job.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_char_p, ctypes.c_long,
                                          ctypes.c_char_p, ctypes.c_int)
        root_lib.ib_loop_start.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_long)
        root_lib.ib_next.argtypes = (ctypes.POINTER(Job),)
        root_lib.ib_wait.argtypes = (ctypes.POINTER(Job), ctypes.c_long)
        root_lib.ib_answer.argtypes = (ctypes.c_char_p,)
        home = own_pid_namespace()
    except OSError as e:
        sys.stderr.write("zygote: %s\n" % e)
        sys.exit(3)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # ROOT_LIB's waits: sigtimedwait
    new_network()
    msg = ctypes.create_string_buffer(1 << 16)  # each job's control message: the loop is ROOT_LIB's (the docstring)
    error = root_lib.ib_loop_start(ctl.fileno(), keeper.fileno() if keeper else -1, home, REAPER.encode(), msg,
                                   len(msg))
    if error:
        sys.stderr.write("zygote: the state jobs must leave as it is: %s\n" % os.strerror(error))
        sys.exit(3)
    # Every job's fork copies the zygote's page tables, write-protects its pages and tears them down, and
    # every page a job (or the zygote after it) writes is a fault: compiling PROGRAM left 2 MB of freed heap
    # resident (of 9.2 MB anonymous), which malloc_trim gives back.
    libc.malloc_trim(0)
    # The collector writes into every object it walks: a full collection in a job copied each page of the
    # zygote's heap. Frozen, what the zygote made is never walked again (MBPP, 2 workers, A/B over 3 rounds:
    # 7.7 -> 7.0 ms of the machine's CPU a case).
    gc.collect()
    gc.freeze()
    ctl.sendall(b'{"ready": true}')
    job = Job()
    while root_lib.ib_next(ctypes.byref(job)) == IB_FORK:
        try:
            pid = os.fork()
        except OSError as e:
            pid = -e.errno
        if pid == 0:
            job_child(job, msg, layers, code, program)
        got = root_lib.ib_wait(ctypes.byref(job), pid)
        if got == IB_NETWORK:  # the job left a trace in the network namespace (the docstring)
            try:
                new_network()
                retire = None if root_lib.ib_net_baseline() == 0 else b"the network's state does not fit"
            except OSError as e:
                retire = ("a job used the network, and no new one could be made: %s" % e).encode()
            got = root_lib.ib_answer(retire)
        if got == IB_END:
            return


def pid_keeper():
    """The socket to the run's pid keeper (init.c pid_keeper: descriptor 3, given where the jobs
    share this pid namespace's /proc), or None."""
    try:
        fd = os.dup(3)
    except OSError:  # none
        return None
    try:
        keeper = socket.socket(fileno=fd)
    except OSError:  # not a socket
        os.close(fd)
        return None
    if (keeper.family, keeper.type) != (socket.AF_UNIX, socket.SOCK_SEQPACKET):
        keeper.close()
        return None
    os.close(3)
    return keeper


def reset_pids(keeper):
    """Ask the keeper to put this pid namespace's counter back to where it was at the first ask."""
    try:
        keeper.sendall(b"r")
        return keeper.recv(1) == b"k"
    except OSError:
        return False


def own_pid_namespace():
    """Make the zygote pid 1 of a pid namespace of its own, owned by its user namespace, and return it (a
    descriptor). A job's pid namespace is made by unshare, which leaves the caller in its own and puts its
    next child (REAPER) in the new one; to make the next job's, the caller must first go back with setns,
    which the run's pid namespace refuses (an outer user namespace owns it), its own does not."""
    check(libc.unshare(NEWPID), "unshare the zygote's pid namespace")
    pid = os.fork()
    if pid:  # the first process: only waits for the zygote, and leaves as it does
        while True:
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status):
                os._exit(os.WEXITSTATUS(status))
            if os.WIFSIGNALED(status):
                os._exit(128 + os.WTERMSIG(status))
    return os.open("/proc/self/ns/pid", os.O_RDONLY)


if __name__ == "__main__":
    if sys.version_info < (3, 8) or os.uname().machine not in MACHINES:
        sys.stderr.write("zygote: needs Python 3.8 or later (os.posix_spawn) on x86_64 or aarch64\n")
        sys.exit(3)
    serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
