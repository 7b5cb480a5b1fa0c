"""Warm interpreters (runtime/warm.py, runtime/zygote.py): each job a clone of one zygote, and still
nothing of one job reaches the next: files, processes, IPC, memory; the zygote never holds a job's
data; limits and timeouts hold; a job that kills its zygote fails only itself."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from image_builder.graders import GradeOptions, grade
from image_builder.graders.grading import StoreExecutors
from image_builder.runtime.backends import open_session
from image_builder.runtime.execution import RunRequest
from image_builder.runtime.session import InstanceLayers
from image_builder.runtime.warm import LAYERS_AT, WarmPool, keeping_cpu, thread_cpu, worker_pool
from image_builder.store.store import Store
from image_builder.tasks import AssertTask
from tests.support.servers import LOCALHOST_SERVER

PROGRAM = ("/tmp/.ib-test/job.py", b"import sys\nexec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'))\n")
SCRIPT = "/tmp/.ib-test/script.py"


@pytest.fixture(scope="module")
def pool(mbpp_store):
    resolved = Store.open(mbpp_store).resolve("512")
    layers = InstanceLayers.of(resolved)
    with open_session(layers, layers_at=LAYERS_AT) as session:
        warm = WarmPool(session, layers, ("python3",), PROGRAM, {}, 256)
        yield warm
        warm.close()


def job(pool: WarmPool, script: str, timeout: float = 20) -> tuple[int | None, str, object]:
    out_r, out_w = os.pipe()
    try:
        result = pool.stream(RunRequest(argv=("python3", PROGRAM[0], SCRIPT), files={SCRIPT: script.encode()},
                                        timeout=timeout, memory_mb=256), None, out_w, out_w)
    finally:
        os.close(out_w)
    with os.fdopen(out_r) as f:
        return result.exit_code, f.read(), result


def test_a_job_leaves_nothing_for_the_next(pool):
    code, out, _ = job(pool, """
import ctypes, os, subprocess, sys
for path in ("/etc/ib-left", "/tmp/ib-left", "/dev/shm/ib-left", "/root/ib-left"):
    open(path, "w").write("x")
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x1B1B, 4096, 0o1666)  # IPC_CREAT | 0666, never removed
assert shm >= 0, ctypes.get_errno()
subprocess.Popen(["python3", "-c", "import time; time.sleep(60)  # ib-left-daemon"],
                 start_new_session=True)  # (a setsid() of its own failed: it is a session's leader already)
import json
json.ib_left = "in memory"
os.environ["IB_LEFT"] = "1"
print("wrote")
""")
    assert (code, out.strip()) == (0, "wrote")
    code, out, _ = job(pool, """
import ctypes, json, os
left = [p for p in ("/etc/ib-left", "/tmp/ib-left", "/dev/shm/ib-left", "/root/ib-left") if os.path.exists(p)]
libc = ctypes.CDLL(None, use_errno=True)
if libc.shmget(0x1B1B, 4096, 0o666) >= 0:
    left.append("shm")
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"ib-left-daemon" in open("/proc/%s/cmdline" % pid, "rb").read():
            left.append("daemon")
    except OSError:
        pass
if hasattr(json, "ib_left") or "IB_LEFT" in os.environ:
    left.append("memory")
print(left)
""")
    assert (code, out.strip()) == (0, "[]")


def test_a_job_sees_no_process_but_its_own_and_the_same_pids_every_time(pool):
    """On the kernel backend a job has its zygote's /proc (a masked one cannot be mounted again): it saw the
    zygote, whose page faults rose about 185 a job, and its own pids there advanced with the jobs before
    it: counts of the cases before it. The init now hides what a job may not trace and resets the pid
    counter before each job (init.c pid_keeper)."""
    probe = """
import os, threading
for t in [threading.Thread(target=int) for _ in range(50)]:
    t.start(); t.join()
print(os.readlink("/proc/self"), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""
    seen = [job(pool, probe)[1].split(None, 1) for _ in range(3)]
    assert seen[0] == seen[1] == seen[2], seen
    assert seen[0][1].strip() == f"[{seen[0][0]}]", seen


def test_a_jobs_pid_1_reaps_its_orphans_and_is_out_of_its_reach(pool):
    """pid 1 of a job is image-builder-init (`reap`, zygote.py REAPER), not a fork of the zygote: it reaps
    what the job leaves it, and the job can neither trace it nor stop it."""
    code, out, _ = job(pool, """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(0.2)
        os._exit(0)
    os.write(w, b"%d" % grandchild)
    os._exit(0)
os.waitpid(child, 0)
orphan = int(os.read(r, 32))
for _ in range(50):  # it exits after 0.2 s; reaped, its pid is gone (a zombie's is not)
    time.sleep(0.05)
    try:
        os.kill(orphan, 0)
    except ProcessLookupError:
        print("reaped")
        break
else:
    print("zombie")
print(os.getpid(), libc.ptrace(16, 1, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
    os.kill(1, sig)  # ignored: pid 1 of its own namespace
time.sleep(0.1)
os.kill(1, 0)
print("pid 1 lives")
""")
    assert code == 0, out
    reaped, traced, alive = out.splitlines()
    assert (reaped, alive) == ("reaped", "pid 1 lives"), out
    pid, result, errno = traced.split()
    assert pid == "2" and result == "-1" and errno in ("1", "13"), out  # EPERM, EACCES


def test_the_zygote_never_holds_a_jobs_data(pool):
    """A later job is a copy of the zygote's memory: it finds nothing of an earlier job's files there."""
    marker = "ib-secret-" + os.urandom(8).hex()
    assert job(pool, f"print({marker!r}[:3])")[0] == 0
    code, out, _ = job(pool, f"""
import re
needle = {marker[:10]!r}.encode() + bytes.fromhex({marker[10:].encode().hex()!r})
found = 0
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if "r" not in line.split()[1] or "[vvar" in line or "[vsyscall" in line:
            continue
        try:
            mem.seek(start)
            found += mem.read(end - start).count(needle)
        except OSError:
            pass
print(found)
""")
    assert (code, out.strip()) == (0, "1")  # this script's own constant only


def test_limits_and_timeouts_hold_and_the_next_job_is_served(pool):
    code, out, result = job(pool, "while True: pass", timeout=1)
    assert result.timed_out and code is None
    code, out, _ = job(pool, "x = bytearray(512 << 20)")
    assert code == 1 and "MemoryError" in out
    code, out, _ = job(pool, "import os; print(os.getpid(), os.getuid())")
    assert (code, out.split()) == (0, ["2", "0"])


def test_a_job_that_kills_its_zygote_fails_only_itself(pool):
    code, _, result = job(pool, """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) != os.getpid():
        try:
            fd = os.open("/proc/" + pid, os.O_RDONLY | os.O_DIRECTORY)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
""")
    assert result.exit_code in (0, None)
    assert job(pool, "print('served')")[:2] == (0, "served\n")


def test_a_host_file_given_as_stdin_reaches_a_job_only_as_a_copy(pool, tmp_path):
    """As Session.stream: a regular file is copied, so the job cannot reopen it for writing."""
    host_file = tmp_path / "input"
    host_file.write_text("precious\n")
    fd = os.open(host_file, os.O_RDWR)
    out_r, out_w = os.pipe()
    try:
        script = ("import os\ntry:\n    open('/proc/self/fd/0', 'w').write('x')\nexcept OSError as e:\n    print(e)\n"
                  "print(os.fstat(0).st_size)")
        result = pool.stream(RunRequest(argv=("python3", PROGRAM[0], SCRIPT), files={SCRIPT: script.encode()},
                                        timeout=20, memory_mb=256), fd, out_w, out_w)
    finally:
        os.close(fd)
        os.close(out_w)
    with os.fdopen(out_r) as f:
        assert result.exit_code == 0, f.read()
    assert host_file.read_text() == "precious\n"


def test_a_job_cannot_stop_its_zygote(pool):
    """The zygote's /proc (kernel backend) shows the zygote, but a signal to it from the job's pid
    namespace, a descendant of the zygote's, is refused (EINVAL; kill() has no pid for it)."""
    code, out, _ = job(pool, """
import os, signal
me = os.readlink("/proc/self")  # pids as the zygote's /proc numbers them
mine = (me, open("/proc/%s/stat" % me).read().rsplit(")", 1)[1].split()[1])  # and the job's pid 1
for pid in filter(str.isdigit, os.listdir("/proc")):
    if pid != "1" and pid not in mine:
        try:
            signal.pidfd_send_signal(os.open("/proc/" + pid, os.O_RDONLY | os.O_DIRECTORY), signal.SIGSTOP)
            print(pid, "stopped")
        except OSError as e:
            print(pid, e.errno)
""", timeout=5)
    assert code == 0 and "stopped" not in out, out
    assert job(pool, "print('served')")[:2] == (0, "served\n")


def test_a_signal_to_the_jobs_process_group_does_not_reach_the_zygote(pool):
    """kill(0, ...) reaches every process of the caller's group, across pid namespaces: a job in the
    zygote's group stopped it (red team). Each job now has a session of its own."""
    code, _, result = job(pool, """
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.kill(0, signal.SIGTERM)
print("survived")
""", timeout=5)
    assert code == 0, result
    assert pool._idle and not pool._idle[0].dead and job(pool, "print('served')")[:2] == (0, "served\n")


def test_closed_connections_leave_nothing_for_the_next_job(pool):
    """A closed TCP connection waits a minute in TIME_WAIT, listed in /proc/net/tcp: in a network namespace
    shared by the jobs, one job wrote there what the next read (red team: a counter across cases)."""
    code, out, _ = job(pool, """
import socket
srv = socket.create_server(("127.0.0.1", 40072))
client = socket.create_connection(("127.0.0.1", 40072))
peer, _ = srv.accept()
client.close(); peer.close(); srv.close()
print(sum(1 for line in open("/proc/net/tcp").read().splitlines()[1:]))
""")
    assert (code, out) == (0, "1\n")  # its own connection, waiting
    code, out, _ = job(pool, "print(open('/proc/net/tcp').read().splitlines()[1:])")
    assert (code, out) == (0, "[]\n")


# What a job of the zygote's network namespace reads of it (zygote.py NET_STATE, and more: the sockets
# themselves, a sysctl, an abstract name), as a digest. Not sockstat: the host's counts (zygote.py).
NET_PRINT = """
import hashlib, socket
seen = [open("/proc/net/" + name).read() for name in ("dev", "snmp", "snmp6", "netstat", "unix", "ip6_flowlabel",
                                                      "tcp", "tcp6", "udp", "udp6")]
seen.append(open("/proc/sys/net/ipv4/ip_local_port_range").read())
s = socket.socket(socket.AF_UNIX)
try:
    s.bind("\\0ib-left")
    seen.append("free")
except OSError:
    seen.append("taken")
print(hashlib.sha256(repr(seen).encode()).hexdigest())
"""
NET_TRACES = {
    "a datagram through lo": """
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b"x" * 77, ("127.0.0.1", 9))
""",
    "a send with no route": """
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"x", ("8.8.8.8", 53))
except OSError:
    pass
""",
    "a connection closed": """
import socket
srv = socket.create_server(("127.0.0.1", 40073))
c = socket.create_connection(("127.0.0.1", 40073))
peer, _ = srv.accept()
c.close(); peer.close(); srv.close()
""",
    "an IPv6 flow label": """
import socket, struct
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
# struct in6_flowlabel_req: dst, label, action GET, share ANY, flags CREATE, expires, linger 60 s
req = bytes(16) + struct.pack("!I", 0x12345) + struct.pack("=BBHHHI", 0, 1, 1, 0, 60, 0)
try:
    s.setsockopt(socket.IPPROTO_IPV6, 32, req)  # IPV6_FLOWLABEL_MGR
except OSError:
    pass
""",
    "a unix socket left in flight": """
import array, socket
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
named = socket.socket(socket.AF_UNIX)
named.bind("\\0ib-left")
a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [named.fileno(), b.fileno()]))])
""",
    "a sysctl written": """
try:
    open("/proc/sys/net/ipv4/ip_local_port_range", "w").write("40000 40001")
except OSError:
    pass
""",
}


@pytest.mark.parametrize("trace", NET_TRACES)
def test_a_job_that_used_the_network_leaves_nothing_in_it_for_the_next(pool, trace):
    """The jobs share the zygote's network namespace while none leaves a trace there (zygote.py): each way a
    job can leave one (counters, a TIME_WAIT, a flow label, a socket in flight under an abstract name, a
    sysctl) is gone for the next job, which reads what a job before any network use read."""
    before = job(pool, NET_PRINT)
    assert before[0] == 0, before
    assert job(pool, NET_TRACES[trace])[0] == 0
    assert job(pool, NET_PRINT)[:2] == before[:2]


def test_jobs_that_leave_no_trace_share_the_zygotes_network_namespace(pool):
    """What the shared namespace is for: a job that opens no socket costs none of its own (1.5-2.7 ms of CPU a case)."""
    def zygotes_nets() -> set[str]:
        found = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if b"zygote.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(os.readlink(f"/proc/{pid}/ns/net"))
            except OSError:
                pass
        return found

    for _ in range(2):
        code, out, _ = job(pool, "import os; print(os.readlink('/proc/self/ns/net'))")
        assert code == 0 and out.strip() in zygotes_nets(), (out, zygotes_nets())


def test_offline_an_address_nobody_answers_times_out_as_with_a_network(pool):
    """As a cold run's (test_runtime.py): a job's network namespace routes the addresses nobody answers on the
    internet into lo, so timeout tests time out offline, and fails every other address at once."""
    from tests.test_runtime import DIAL, SILENT_OFFLINE
    for _ in range(2):
        code, out, _ = job(pool, DIAL)
        assert (code, out.encode()) == (0, SILENT_OFFLINE)


def test_localhost_resolves_in_a_job(pool):
    """A job's root is made from the layers, not from its zygote's root (which its init gave Docker's
    /etc/hosts): it gets one too, or a server on `localhost` fails with a name-resolution error."""
    code, out, _ = job(pool, LOCALHOST_SERVER + 'print(open("/etc/hosts").read().split()[:2])\n')
    assert (code, out) == (0, "200\n['127.0.0.1', 'localhost']\n"), out


def test_a_job_cannot_slow_down_the_next(pool):
    """A job that renices its scheduler autogroup (/proc/self/autogroup, or its zygote's) must not leave the
    next job at nice 19 (red team: an honest task timed out behind a job that wrote 19 there): each job has
    an autogroup of its own, and its zygote it cannot see (hidepid; a zygote whose own group changed would
    serve no more)."""
    assert os.path.exists("/proc/self/autogroup"), "this test needs a kernel with scheduler autogroups"
    code, out, _ = job(pool, """
import os, time
me = os.readlink("/proc/self")  # pids as the zygote's /proc numbers them (kernel backend)
zygotes = [p for p in os.listdir("/proc") if p.isdigit() and p != me and b"zygote.py" in open(
    "/proc/%s/cmdline" % p, "rb").read()]
for pid in ["self"] + zygotes:
    time.sleep(0.11)  # the kernel takes one change a tenth of a second from a process without CAP_SYS_ADMIN
    with open("/proc/%s/autogroup" % pid, "w") as f:
        f.write("19")
print(open("/proc/self/autogroup").read().split()[-1], [open("/proc/%s/autogroup" % p).read().split()[-1]
                                                        for p in zygotes])
""")
    assert (code, out) == (0, "19 []\n"), out  # its own group; no zygote in sight
    code, out, _ = job(pool, "print(open('/proc/self/autogroup').read().split()[-1])")
    assert (code, out) == (0, "0\n")


def _hung_zygotes() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"IB=ib-hung-zygote\0" in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_zygote_that_stops_answering_is_killed_with_its_run(mbpp_store, monkeypatch):
    """Whatever keeps a zygote from answering, the job reads as killed after its timeout and the
    zygote's run goes (a stopped or hung one would otherwise hold the job's output pipes)."""
    import image_builder.runtime.warm as warm
    monkeypatch.setattr(warm, "GRACE", 1.0)
    monkeypatch.setattr(warm, "ZYGOTE", b"import os, time\nos.write(0, b'{\"ready\": true}')\ntime.sleep(3600)\n")
    resolved = Store.open(mbpp_store).resolve("512")
    layers = InstanceLayers.of(resolved)
    with open_session(layers, layers_at=LAYERS_AT) as session:
        hung = WarmPool(session, layers, ("python3",), None, {"IB": "ib-hung-zygote"}, 256)
        with ThreadPoolExecutor(1) as threads:
            running = threads.submit(hung.run, RunRequest(argv=("python3", SCRIPT), files={SCRIPT: b"pass"},
                                                          timeout=2, memory_mb=256))
            time.sleep(1.5)
            assert len(_hung_zygotes()) == 1  # the zygote's command, with the environment it was given
            result = running.result()
        assert (result.exit_code, result.signal, hung.busy) == (None, 9, 0), result
        assert _hung_zygotes() == []


SCRIPTS = {  # what a fresh `python3 FILE` gives: the same from a warm interpreter of any script
    "names": "import sys; print(__name__, __file__, sys.argv, sys.path[0], __builtins__.__name__)",
    "raises": "def f():\n    return 1 / 0\nf()\n",
    "syntax": "def f(:\n    pass\n",
    "exit text": "import sys; sys.exit('bye')",
    "exit code": "import sys; print('out'); sys.stderr.write('err\\n'); sys.exit(3)",
    "stdin file": "import os, sys; print(os.fstat(0).st_size, sys.stdin.read().split())",
    "atexit": "import atexit; atexit.register(print, 'at exit'); print('main')",
    "excepthook": "import sys; sys.excepthook = lambda *a: print('hooked', a[0].__name__); raise KeyError(1)",
    "too much": "print('x' * 100000)",
}


@pytest.mark.parametrize("relative", [False, True])
def test_any_script_runs_warm_as_a_fresh_interpreter_runs_it(pool, relative):
    warm = WarmPool(pool.session, pool.layers, ("python3",), None, {}, 256)
    try:
        for name, script in SCRIPTS.items():
            path = "s.py" if relative else SCRIPT
            request = RunRequest(argv=("python3", path, "a b", "c"), files={path: script.encode()}, stdin=b"1 2\n3",
                                 timeout=20, memory_mb=256, max_output=4096)
            assert warm.takes(request)
            fresh, clone = pool.session.run(request), warm.run(request)
            assert (clone.exit_code, clone.stdout, clone.stderr, clone.truncated) == \
                (fresh.exit_code, fresh.stdout, fresh.stderr, fresh.truncated), name
        missing = RunRequest(argv=("python3", "/nowhere.py"), timeout=20, memory_mb=256)
        assert warm.run(missing).exit_code == pool.session.run(missing).exit_code == 2
        assert not warm.failed and warm.busy == 0
    finally:
        warm.close()


ONCE = b"""import os, sys
MADE_IN = os.getpid()
SEEN = []
def zygote_job():
    SEEN.append(sys.argv[1])
    print(__name__, MADE_IN != os.getpid(), SEEN, sys.modules["__main__"].__name__)
if __name__ == "__main__":
    zygote_job()
"""


def test_a_job_inherits_the_zygotes_objects_frozen_and_collects_its_own(pool):
    """The zygote freezes what it made (gc.freeze: a collection in a job would write into every object of
    the zygote's heap, a page copied each); a job's own cycles are still collected."""
    code, out, _ = job(pool, """
import gc
class Cycle:
    pass
c = Cycle(); c.me = c; del c
print(gc.get_freeze_count() > 1000, gc.collect() >= 1)
""")
    assert (code, out.strip()) == (0, "True True"), out


def test_a_job_finds_the_modules_solutions_import_most_already_imported(pool):
    """zygote.PRELOAD: a solution's `import re` (or heapq, bisect, ...) costs its job nothing."""
    code, out, _ = job(pool, "import sys\nprint(sorted(m for m in ('re', 'heapq', 'bisect', 'math') if m in sys.modules))")
    assert (code, out.strip()) == (0, "['bisect', 'heapq', 'math', 're']"), out


def test_a_program_with_a_zygote_job_runs_its_top_level_once_and_each_job_from_there(pool):
    """A program that defines zygote_job (a grader's own, assert_sides.py) has its top level run in the
    zygote, once; each job calls zygote_job() on a copy of that module, and what a job changes in it is
    gone for the next (a fresh interpreter runs the file's top level itself)."""
    program = ("/tmp/.ib-test/once.py", ONCE)
    warm = WarmPool(pool.session, pool.layers, ("python3",), program, {}, 256)
    try:
        runs = [warm.run(RunRequest(argv=("python3", program[0], arg), timeout=20, memory_mb=256)) for arg in "ab"]
        fresh = pool.session.run(RunRequest(argv=("python3", program[0], "c"), files=dict([program]), timeout=20))
    finally:
        warm.close()
    assert [(r.exit_code, r.stdout) for r in runs] == [(0, b"__ib_program__ True ['a'] __ib_program__\n"),
                                                       (0, b"__ib_program__ True ['b'] __ib_program__\n")], runs
    assert (fresh.exit_code, fresh.stdout) == (0, b"__main__ False ['c'] __main__\n"), fresh


def test_a_job_whose_file_cannot_be_written_fails_saying_where_and_the_next_is_served(pool):
    """The job's files are written by ROOT_LIB (native/zygote_root.c ib_enter_job) in the job's root: one
    under a file fails the job, naming the path, and nothing of it reaches the next job."""
    out_r, out_w = os.pipe()
    try:
        result = pool.stream(RunRequest(argv=("python3", PROGRAM[0], SCRIPT),
                                        files={SCRIPT: b"print('ran')\n", "/etc/passwd/x": b"1"},
                                        timeout=20, memory_mb=256), None, out_w, out_w)
    finally:
        os.close(out_w)
    with os.fdopen(out_r) as f:
        said = f.read()
    assert result.exit_code == 127 and "/etc/passwd/x: Not a directory" in said and "ran" not in said, said
    code, out, _ = job(pool, "import os; print(os.path.exists('/etc/passwd/x'), open('/tmp/.ib-test/script.py').read())")
    assert (code, out) == (0, "False import os; print(os.path.exists('/etc/passwd/x'), "
                              "open('/tmp/.ib-test/script.py').read())\n"), out


def test_without_its_root_library_cases_run_in_fresh_interpreters(mbpp_store, monkeypatch):
    """image-builder-zygote.so (native/zygote_root.c) missing: warm interpreters say why, before any job ran,
    and the cases run the ordinary way."""
    import image_builder.runtime.warm as warm
    monkeypatch.setattr(warm, "zygote_library", lambda: None)
    warm.root_library.cache_clear()
    try:
        task = AssertTask("512", ("assert f(1) == 2", "assert f(2) == 3"), "512")
        with StoreExecutors(Store.open(mbpp_store)) as executors:
            result = grade(task, "def f(x):\n    return x + 1\n", executors.for_instance("512"), GradeOptions())
            failed = [p.failed for pools in executors._warm.values() for p in pools.pools.values()]
    finally:
        warm.root_library.cache_clear()
    assert result.score == 1.0, [(c.status, c.reason, c.stderr_tail) for c in result.cases]
    assert failed and all("image-builder-zygote.so not found" in f for f in failed), failed


def test_graded_cases_run_warm_and_a_candidate_sees_no_evaluator(mbpp_store):
    task = AssertTask("512", ("assert f(1) == 2", "assert f(2) == 3"), "512")
    spy = """
import os
def f(x):
    seen = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            seen.append(open("/proc/%s/cmdline" % pid, "rb").read())
        except OSError:
            pass
    # The evaluators' zygote (and each clone of it: no exec) runs `python3 -S`, the candidates' does not.
    assert not any(c.startswith(b"python3\\x00-S\\x00") or b"_ib_cases" in c for c in seen), seen
    return x + 1
"""
    with StoreExecutors(Store.open(mbpp_store)) as executors:
        executor = executors.for_instance("512")
        # The second task finds the evaluators' zygote too (one run a task: it pays from the second).
        results = [grade(task, spy, executor, GradeOptions(case_timeout=10)) for _ in range(2)]
        pools = [p for pools in executors._warm.values() for p in pools.pools.values()]
    assert [r.score for r in results] == [1.0, 1.0], [(c.status, c.reason, c.stderr_tail) for c in results[-1].cases]
    assert len(pools) == 2 and not any(p.failed for p in pools)  # evaluators' and candidates' zygotes


ROOTLESS = """
import os, sys
from pathlib import Path
from image_builder.runtime.backends import open_session
from image_builder.runtime.execution import RunRequest
from image_builder.runtime.session import InstanceLayers
from image_builder.runtime.warm import LAYERS_AT, WarmPool, worker_pool
from image_builder.store.store import Store
PROGRAM = %r
resolved = Store.open(Path(sys.argv[1])).resolve("512")
layers = InstanceLayers.of(resolved)
script = (b"import os, re\\n"
          b"try:\\n    os.listdir('/proc/1/root/tmp'); zygotes = 'read'\\nexcept PermissionError:\\n    zygotes = 'denied'\\n"
          b"groups = [int(re.search(r'-(\\\\d+)', open(f'/proc/{p}/autogroup').read())[1]) for p in (1, 'self')]\\n"
          b"print(os.path.exists('/etc/ib-left'), sorted(p for p in os.listdir('/proc') if p.isdigit()), "
          b"os.getuid(), os.access('/proc/sys/net/ipv4/ip_local_port_range', os.W_OK), zygotes, "
          b"groups[1] - groups[0] < 50)\\n"
          b"open('/etc/ib-left', 'w').close()\\n"
          b"for _ in range(300):\\n    p = os.fork()\\n    if not p:\\n        os.setsid(); os._exit(0)\\n    os.waitpid(p, 0)\\n")
with open_session(layers, layers_at=LAYERS_AT) as session:
    pool = WarmPool(session, layers, ("python3",), PROGRAM, {}, 256)
    for _ in range(2):
        out_r, out_w = os.pipe()
        r = pool.stream(RunRequest(argv=("python3", PROGRAM[0], "/tmp/s.py"), files={"/tmp/s.py": script}, timeout=20),
                        None, out_w, out_w)
        os.close(out_w)
        print(r.exit_code, os.read(out_r, 4096).decode().strip(), flush=True)
    pool.close()
"""


def test_rootless_jobs_get_a_proc_of_their_own(mbpp_store, public_dir):
    """As uid 65534 (userns backend, squashfuse): each job mounts /proc for its own pid namespace."""
    home = public_dir / "warm-rootless"
    home.mkdir()
    os.chown(home, 65534, 65534)
    script = home / "rootless.py"
    script.write_text(ROOTLESS % (PROGRAM,))
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, str(script),
                        str(mbpp_store)], capture_output=True, text=True, cwd=str(Path(__file__).parents[1]),
                       env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": ""}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # pids 1 (the job's init) and 2 (the job) only, root inside; the file written is not there for the next; the
    # shared network namespace's sysctls, which the job's uid owns there, are read-only; the init's root (the
    # zygote's: pid 1 stays in its mount namespace) is out of the job's reach; the sessions a job makes (300)
    # are no count the next reads against its init's (red team: that init's session was the zygote's, older)
    assert r.stdout.splitlines() == ["0 False ['1', '2'] 0 False denied True"] * 2, r.stdout


def test_where_no_zygote_starts_cases_run_in_fresh_interpreters(mbpp_store, monkeypatch):
    """Python 3.6, an odd machine, a layer stack without /proc: the zygote says so before any job ran."""
    import image_builder.runtime.warm as warm
    monkeypatch.setattr(warm, "ZYGOTE", b"import sys\nsys.stderr.write('zygote: not here\\n')\nsys.exit(3)\n")
    task = AssertTask("512", ("assert f(1) == 2", "assert f(2) == 3"), "512")
    with StoreExecutors(Store.open(mbpp_store)) as executors:
        result = grade(task, "def f(x):\n    return x + 1\n", executors.for_instance("512"), GradeOptions())
        failed = [p.failed for pools in executors._warm.values() for p in pools.pools.values()]
    assert result.score == 1.0, [(c.status, c.reason, c.stderr_tail) for c in result.cases]
    assert len(failed) == 1 and "zygote: not here" in failed[0], failed


def test_jobs_over_a_masked_proc_leave_nothing_in_the_kernel_log(pool):
    """Root (kernel backend: the zygote's /proc is masked): each job binds it instead of asking for a new
    one, which the kernel refuses with a "VFS: Mount too revealing" line in the log (1.5 ms a job, and an
    admin's log flooded)."""
    assert os.geteuid() == 0
    kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.lseek(kmsg, 0, os.SEEK_END)
        for _ in range(3):
            code, out, _ = job(pool, "import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
            assert code == 0 and out.startswith("["), out  # a /proc it can list
        logged = []
        while True:
            try:
                logged.append(os.read(kmsg, 8192).decode(errors="replace"))
            except BlockingIOError:
                break
            except OSError:  # a record overwritten meanwhile (EPIPE): read on
                continue
    finally:
        os.close(kmsg)
    assert not [line for line in logged if "too revealing" in line], logged


def test_a_job_runs_on_the_cpu_its_sender_was_given_and_nothing_else_keeps_to_it(pool, mbpp_store):
    """worker_pool gives its threads one CPU each, in turn (as many threads as CPUs); a warm job sent from such a
    thread, or from a thread it starts through keeping_cpu (a case's candidate run), runs there (zygote_root.c
    keep_to: the zygote moves before REAPER and the fork). Nothing else keeps to that CPU: not the threads
    themselves, not a session one opens nor its ordinary runs (a SWE-bench test suite: pylint's needs_two_cores
    tests skipped when grade's threads kept to one), not a zygote one starts, whose jobs from a free thread run
    on every CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    where = "import os\nprint(sorted(os.sched_getaffinity(0)))"

    def kept(_: int) -> tuple[int, list[int], str, str]:
        carried: list[str] = []
        candidate = threading.Thread(target=keeping_cpu(lambda: carried.append(job(pool, where)[1].strip())))
        candidate.start()
        candidate.join()
        return thread_cpu(), sorted(os.sched_getaffinity(0)), job(pool, where)[1].strip(), carried[0]

    with worker_pool(len(cpus)) as workers:
        got = list(workers.map(kept, range(4 * len(cpus))))
    assert sorted({given for given, *_ in got}) == cpus, got
    assert all(own == cpus and out == carried == str([given]) for given, own, out, carried in got), got
    assert job(pool, where)[1].strip() == str(cpus), "a job from a free thread stayed on the last CPU"

    layers = InstanceLayers.of(Store.open(mbpp_store).resolve("512"))

    def opened(_: int) -> tuple[str, str, str]:
        with open_session(layers, layers_at=LAYERS_AT) as session:
            ordinary = session.run(RunRequest(argv=("python3", "-c", where), timeout=20)).stdout.decode().strip()
            warm = WarmPool(session, layers, ("python3",), PROGRAM, {}, 256)
            try:
                given = job(warm, where)[1].strip()
                free: list[str] = []
                other = threading.Thread(target=lambda: free.append(job(warm, where)[1].strip()))
                other.start()
                other.join()
                return ordinary, given, free[0]
            finally:
                warm.close()

    with worker_pool(len(cpus)) as workers:
        ordinary, given, free = workers.submit(opened, 0).result()
    assert ordinary == free == str(cpus) and given in [str([c]) for c in cpus], (ordinary, given, free)
    if len(cpus) > 1:
        with worker_pool(len(cpus) - 1) as fewer:
            assert fewer.submit(thread_cpu).result() == -1
