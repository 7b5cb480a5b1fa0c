/* image-builder-zygote.so: a warm interpreter's job enters its root, then takes its files, stdio and
 * limits, in two calls; and the zygote's loop between jobs (runtime/zygote.py; at the end of this file).
 *
 * A zygote's job is a fork of a Python process. Built in Python, a ctypes call per mount, its
 * root cost each job 1.4 ms and 250 copy-on-write faults (40 MBPP tasks one at a time, medians),
 * and its files and limits 0.3-0.6 ms and 60-130 more: every interpreter object a call touches is
 * a page copied. These calls touch their stack and their arguments.
 *
 * Freestanding (no libc: raw system calls, the kernel's own headers), so it loads into whatever
 * interpreter an image has, glibc or musl, old or new. It is loaded once by the zygote; the two
 * calls above are made in each job's process, after the fork, and keep no state; the loop keeps its own.
 *
 * int ib_enter_root(const char *const opts[4], int proc_masked, int etc_mode, long max_processes,
 *                   const int *keep, int nkeep, char *step, int steplen)
 *   opts: the overlay's (lowerdir=LAYERS,...), and the scratch tmpfs's, /tmp's and /dev/shm's
 *   (mode and size); etc_mode: the layers' /etc's mode where it has no hosts file, else 0.
 *   Closes every descriptor above 2 but `keep`, takes a session of its own, builds the root
 *   (zygote.py's docstring) and drops into a nested user namespace.
 *   Returns 0, or an errno with the failed step's name in `step`.
 *
 * int ib_enter_job(const int fds[4], int failed_w, const char *workdir, long memory_bytes,
 *                  char *step, int steplen)
 *   In that root: fds[0..2] as stdin, stdout, stderr; the job's files written out of the memfd
 *   fds[3] (warm.py's format); fds and failed_w closed; workdir made and entered; no core
 *   files, and the address space limited to memory_bytes (0: no limit). Returns as the first.
 */
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/mount.h>
#include <linux/resource.h>
#include <linux/sched.h>
#include <linux/stat.h>

#include "hosts.h"

#define ROOT "/tmp/.ib-job" /* where the job's root is built: in its own mount namespace, on its own /tmp */
#define MNT_DETACH 2
#define SIG_UNBLOCK 1
#define SIGCHLD 17

#if defined(__x86_64__)
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long r10 __asm__("r10") = d, r8 __asm__("r8") = e, r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#elif defined(__aarch64__)
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d, x4 __asm__("x4") = e, x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
}
#else
#error "x86_64 or aarch64 (zygote.py MACHINES)"
#endif

#define SYS(n, ...) sys_(n, __VA_ARGS__, 0, 0, 0, 0, 0, 0)
#define sys_(n, a, b, c, d, e, f, ...) sys6(__NR_##n, (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f))

struct failed { char *step; int len; };

/* The step's name and errno, from a system call's return (-errno). */
static int failed(struct failed *f, const char *step, long ret) {
    int i = 0;
    for (; step[i] && i < f->len - 1; i++)
        f->step[i] = step[i];
    if (f->len > 0)
        f->step[i] = 0;
    return ret < 0 && ret > -4096 ? (int)-ret : 5 /* EIO: not a system call's */;
}

static long mount_(const char *src, const char *dst, const char *type, unsigned long flags, const char *data) {
    return SYS(mount, src, dst, type, flags, data);
}

static int is_kept(int fd, const int *keep, int nkeep) {
    for (int i = 0; i < nkeep; i++)
        if (keep[i] == fd)
            return 1;
    return 0;
}

/* Every descriptor above 2 but `keep` (and the listing's own), as /proc/self/fd lists them. */
static long close_others(const int *keep, int nkeep) {
    char buf[4096];
    long dir = SYS(openat, AT_FDCWD, "/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        return dir;
    for (;;) {
        long n = SYS(getdents64, dir, buf, sizeof buf);
        if (n <= 0) {
            SYS(close, dir);
            return n;
        }
        for (long at = 0; at < n;) {
            /* struct linux_dirent64: u64 ino, s64 off, u16 reclen, u8 type, name */
            unsigned short reclen = *(unsigned short *)(buf + at + 16);
            const char *name = buf + at + 19;
            int fd = 0, digits = 0;
            for (; *name >= '0' && *name <= '9'; name++, digits++)
                fd = fd * 10 + (*name - '0');
            if (digits && !*name && fd > 2 && fd != dir && !is_kept(fd, keep, nkeep))
                SYS(close, fd);
            at += reclen;
        }
    }
}

static long length(const char *s) {
    long n = 0;
    while (s[n])
        n++;
    return n;
}

static long write_file(const char *path, const char *text) {
    long len = length(text);
    long fd = SYS(openat, AT_FDCWD, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return fd;
    long r = SYS(write, fd, text, len);
    SYS(close, fd);
    return r < 0 ? r : r == len ? 0 : -5;
}

/* Docker's /etc/hosts (hosts.h), for layers that have none, written into the job's writable layer
   before the overlay is mounted: a plain tmpfs file, where creating it through the overlay (a copy-up of
   /etc) cost 5% of a job's root. */
static void default_hosts(int etc_mode) {
    if (SYS(mkdirat, AT_FDCWD, "/tmp/u/etc", etc_mode))
        return; /* a full layer: the job goes on without */
    long fd = SYS(openat, AT_FDCWD, "/tmp/u/etc/hosts", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
        SYS(write, fd, HOSTS, sizeof HOSTS - 1);
        SYS(close, fd);
    }
}

/* The folders of `path` (and `path` itself with `whole`), as os.makedirs(exist_ok=True) makes them. */
static long make_dirs(const char *path, int whole) {
    char buf[4096];
    int n = 0;
    for (; path[n]; n++) {
        if (n >= (int)sizeof buf - 1)
            return -36; /* ENAMETOOLONG */
        buf[n] = path[n];
    }
    buf[n] = 0;
    for (int i = 1; i <= n; i++) {
        if (i == n ? !whole : buf[i] != '/')
            continue;
        char c = buf[i];
        buf[i] = 0;
        long r = SYS(mkdirat, AT_FDCWD, buf, 0777);
        buf[i] = c;
        if (r && r != -17 /* EEXIST */)
            return r;
    }
    return 0;
}

static long write_all(long fd, const unsigned char *data, unsigned long size) {
    while (size) {
        long w = SYS(write, fd, data, size > (1UL << 30) ? (1UL << 30) : size);
        if (w < 0)
            return w;
        data += w;
        size -= w;
    }
    return 0;
}

/* The job's files out of `blob` (warm.py: per file u32 path length, path, u64 size, bytes). */
static long write_files(const unsigned char *blob, unsigned long size, struct failed *f) {
    char path[4096];
    unsigned long at = 0;
    while (at < size) {
        unsigned int n;
        unsigned long len;
        if (size - at < 4)
            return failed(f, "the job's files", -22);
        n = blob[at] | blob[at + 1] << 8 | blob[at + 2] << 16 | (unsigned int)blob[at + 3] << 24;
        at += 4;
        if (n == 0 || n >= sizeof path || size - at < n + 8UL)
            return failed(f, "the job's files", -22);
        for (unsigned int k = 0; k < n; k++)
            if (!(path[k] = blob[at + k]))
                return failed(f, "the job's files", -22);
        path[n] = 0;
        at += n;
        len = 0;
        for (int k = 7; k >= 0; k--)
            len = len << 8 | blob[at + k];
        at += 8;
        if (size - at < len)
            return failed(f, "the job's files", -22);
        /* Non-blocking, and a regular file only, as init.c writes a run's: a fifo in the image must not hang
           the job, nor anything but a file take the data. */
        long r = make_dirs(path, 0), fd = r ? r : SYS(openat, AT_FDCWD, path,
                                                       O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0666);
        struct statx st;
        if (fd >= 0 && (SYS(statx, fd, "", AT_EMPTY_PATH, STATX_TYPE, &st) || (st.stx_mode & S_IFMT) != S_IFREG)) {
            SYS(close, fd);
            fd = -17; /* EEXIST: not a regular file in the instance */
        }
        if (fd < 0)
            return failed(f, path, fd);
        r = write_all(fd, blob + at, len);
        SYS(close, fd);
        if (r)
            return failed(f, path, r);
        at += len;
    }
    return 0;
}

/* The job's stdio (fds[0..2]), its files (the memfd fds[3]), its workdir and limits, in its root; closes
   fds and failed_w. Returns 0, or an errno with the failed step in `step`. */
int ib_enter_job(const int fds[4], int failed_w, const char *workdir, long memory_bytes, char *step, int steplen) {
    struct failed f = {step, steplen};
    struct statx st;
    struct rlimit none = {0, 0}, memory = {(unsigned long)memory_bytes, (unsigned long)memory_bytes};
    long r;
    for (int i = 0; i < 3; i++) /* dup3: aarch64 has no dup2 */
        if (fds[i] != i && (r = SYS(dup3, fds[i], i, 0)) < 0)
            return failed(&f, "the job's stdio", r);
    int jobfd = fds[3];
    for (int i = 0; i < 3; i++)
        if (fds[i] > 2 && fds[i] != jobfd)
            SYS(close, fds[i]);
    if (failed_w > 2 && failed_w != jobfd)
        SYS(close, failed_w);
    if ((r = SYS(statx, jobfd, "", AT_EMPTY_PATH, STATX_SIZE, &st)))
        return failed(&f, "the job's files", r);
    if (st.stx_size) {
        long map = SYS(mmap, 0, st.stx_size, 1 /* PROT_READ */, 2 /* MAP_PRIVATE */, jobfd, 0);
        if (map < 0 && map > -4096)
            return failed(&f, "the job's files", map);
        r = write_files((const unsigned char *)map, st.stx_size, &f);
        SYS(munmap, map, st.stx_size);
        if (r)
            return (int)r;
    }
    SYS(close, jobfd);
    if ((r = make_dirs(workdir, 1)) || (r = SYS(chdir, workdir)))
        return failed(&f, workdir, r);
    if ((r = SYS(prlimit64, 0, RLIMIT_CORE, &none, 0)) ||
        (memory_bytes && (r = SYS(prlimit64, 0, RLIMIT_AS, &memory, 0))))
        return failed(&f, "limit the job", r);
    return 0;
}

int ib_enter_root(const char *const opts[4], int proc_masked, int etc_mode, long max_processes, const int *keep,
                  int nkeep, char *step, int steplen) {
    struct failed f = {step, steplen};
    unsigned long chld = 1UL << (SIGCHLD - 1);
    struct rlimit nproc = {(unsigned long)max_processes, (unsigned long)max_processes};
    struct statx st;
    long r;
    if ((r = close_others(keep, nkeep)))
        return failed(&f, "close the zygote's descriptors", r);
    if ((r = SYS(rt_sigprocmask, SIG_UNBLOCK, &chld, 0, sizeof chld)))
        return failed(&f, "unblock SIGCHLD", r);
    /* A session of its own, as init.c gives every command: a process group that kill(0, ...) cannot
       reach the zygote through, and a scheduler autogroup whose nice the next job does not inherit. */
    if ((r = SYS(setsid, 0)) < 0)
        return failed(&f, "setsid", r);
    if ((r = SYS(unshare, CLONE_NEWNS | CLONE_NEWIPC)))
        return failed(&f, "unshare", r);
    if ((r = mount_("none", "/", 0, MS_REC | MS_PRIVATE, 0)))
        return failed(&f, "mount /", r);
    if ((r = mount_("scratch", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts[1])))
        return failed(&f, "mount /tmp", r);
    static const char *const made[] = {"/tmp/u", "/tmp/w", ROOT};
    for (int i = 0; i < 3; i++)
        if ((r = SYS(mkdirat, AT_FDCWD, made[i], 0755)))
            return failed(&f, made[i], r);
    if (etc_mode)
        default_hosts(etc_mode);
    if ((r = mount_("overlay", ROOT, "overlay", MS_NOSUID | MS_NODEV, opts[0])))
        return failed(&f, "mount " ROOT, r);
    if ((r = SYS(chdir, ROOT)))
        return failed(&f, "chdir " ROOT, r);
    static const char *const dirs[] = {"proc", "dev", "tmp"};
    for (int i = 0; i < 3; i++) {
        r = SYS(statx, AT_FDCWD, dirs[i], AT_SYMLINK_NOFOLLOW, STATX_TYPE, &st);
        if (r || (st.stx_mode & S_IFMT) != S_IFDIR)
            return failed(&f, i == 0 ? "the layers' /proc" : i == 1 ? "the layers' /dev" : "the layers' /tmp",
                          r ? r : -20 /* ENOTDIR */);
    }
    if ((r = mount_("tmp", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts[2])))
        return failed(&f, "mount /tmp", r);
    /* A masked /proc (kernel backend) cannot be mounted anew from a user namespace, and the kernel logs
       "Mount too revealing" each time (1.5 ms a job): that one is bound, masks and all (every job's:
       zygote.py retires on a change to its top). */
    if ((proc_masked || mount_("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, 0)) &&
        (r = mount_("/proc", "proc", 0, MS_BIND | MS_REC, 0)))
        return failed(&f, "mount /proc", r);
    /* Its net files' owner is the network namespace's root, which the job's uid is: it could set there what
       the next job of the shared namespace reads (zygote.py). A masked /proc has it read-only already. */
    if ((r = mount_("proc/sys", "proc/sys", 0, MS_BIND | MS_REC, 0)) ||
        (r = mount_("none", "proc/sys", 0, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, 0)))
        return failed(&f, "make /proc/sys read-only", r);
    if ((r = mount_("/dev", "dev", 0, MS_BIND | MS_REC, 0))) /* its nodes are read-only binds (runtime/mounts.py) */
        return failed(&f, "mount /dev", r);
    /* A devpts of the job's own: the zygote's was every job's (the times of its top carried a count). */
    if ((r = mount_("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")))
        return failed(&f, "mount /dev/pts", r);
    if ((r = mount_("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts[3])))
        return failed(&f, "mount /dev/shm", r);
    if ((r = SYS(pivot_root, ".", ".")))
        return failed(&f, "pivot_root", r);
    if ((r = SYS(umount2, ".", MNT_DETACH)))
        return failed(&f, "detach the zygote's root", r);
    if ((r = SYS(chdir, "/")))
        return failed(&f, "chdir /", r);
    /* Counted in the new user namespace; then none of the mounts above is the job's to undo. */
    if ((r = SYS(prlimit64, 0, RLIMIT_NPROC, &nproc, 0)))
        return failed(&f, "limit the processes", r);
    if ((r = SYS(unshare, CLONE_NEWUSER)))
        return failed(&f, "unshare the user namespace", r);
    if ((r = write_file("/proc/self/setgroups", "deny")) || (r = write_file("/proc/self/uid_map", "0 0 1")) ||
        (r = write_file("/proc/self/gid_map", "0 0 1")))
        return failed(&f, "map the user namespace", r);
    return 0;
}

/* ---- the zygote's loop (zygote.py serve) --------------------------------------------------------------------
 *
 * Between two jobs the zygote receives the next, resets the pid keeper, makes the job's pid namespace and its
 * REAPER, and after Python's fork waits for the job and answers. In Python that loop wrote over about 200 pages
 * of the interpreter's heap each job, a copy-on-write fault each, since the fork shares them (figures in
 * zygote.py); here it writes its stack, this file's state below and the message.
 *
 * int ib_loop_start(int ctl, int keeper, int home, const char *reaper, char *msg, long room)
 *   ctl: the control socket; keeper: the pid keeper's socket or -1; home: the zygote's own pid namespace;
 *   msg, room: where each job's message is received. Reads what the jobs must leave as it is (the zygote's
 *   autogroup, the times of /proc) and the network's state. Returns 0 or an errno.
 * int ib_net_baseline(void)
 *   The network's state now is the one jobs must leave (after the zygote made a new namespace).
 * int ib_next(struct ib_job *job)
 *   The next job: IB_FORK with its REAPER up as pid 1 of a new pid namespace, the zygote on the job's CPU where
 *   its header names one (keep_to): the caller forks the job's
 *   process now (the fork's child, pid 2, takes up `job`), then calls ib_wait. IB_END: no more jobs. A job
 *   that cannot start is answered {"error": ...} here (warm.py runs it the ordinary way).
 * int ib_wait(struct ib_job *job, long pid)
 *   In the zygote after the fork (pid < 0: -errno of a failed one): back to its own pid namespace, waits for
 *   the job (its timeout), kills REAPER and with it the rest, answers. IB_NEXT: answered; IB_END: answered
 *   with "retire"; IB_NETWORK: the job changed the network's state: the caller makes a new namespace, then
 *   ib_answer sends the answer.
 * int ib_answer(const char *retire)
 *   Sends the answer ib_wait kept, with "retire": `retire` unless NULL. IB_NEXT or IB_END.
 */
#include <linux/poll.h>
#include <linux/time_types.h>

enum { IB_END, IB_FORK, IB_NEXT, IB_NETWORK };

struct ib_job {      /* zygote.py Job */
    long msg_len;    /* the job's message (marshal) in msg, after its header */
    int fds[4];      /* stdin, stdout, stderr, the files' memfd */
    int failed_w;    /* where the job's process says why it did not start */
};

#define HEADER 16               /* a message starts with the job's timeout in microseconds and its CPU (int64s,
                                   < 0: none) */
#define CPU_BYTES 128           /* a CPU mask: 1024 CPUs */
#define NET_ROOM (64 << 10)     /* the network's state, each copy (about 12 kB in a namespace with only lo) */
#define ANSWER_ROOM 4608
#define START_TIMEOUT_MS 10000  /* for REAPER to say it is ready */
#define SIGKILL 9
#define WNOHANG 1
#define SIG_SETMASK 2
#define MSG_CMSG_CLOEXEC 0x40000000
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define CLOCK_MONOTONIC 1

struct iovec_ { void *base; unsigned long len; };
struct msghdr_ { void *name; int namelen; struct iovec_ *iov; unsigned long iovlen; void *control;
                 unsigned long controllen; int flags; };
struct cmsghdr_ { unsigned long len; int level, type; };
struct sigaction_ { unsigned long handler, flags, restorer, mask; };

static struct {
    int ctl, keeper, home, reaper, failed_r;
    char reaper_path[256];
    char *msg;
    long room, timeout_us;
    char autogroup[256];
    long autogroup_len;
    struct statx proc;
    long net_len;
    char net[NET_ROOM], now[NET_ROOM];
    char answer[ANSWER_ROOM];
    int answer_len;
    long cpu;                            /* the CPU the zygote keeps to now, or -1: those it started with */
    unsigned char cpus[CPU_BYTES];       /* the CPUs it started with */
    long cpus_len;                       /* their mask's length, or <= 0: unknown (never changed then) */
} loop;

/* The child of the vfork-style clone below: on its own stack, in the zygote's memory (so it writes none),
   the zygote stopped until it execs REAPER. */
struct spawn { int ready_w; const char *argv[3]; const char *envp[1]; unsigned long mask; };

/* clone(flags, stack) that runs fn(arg) on `stack` in the child, which then exits with fn's value; the caller's
   view: the child's pid or -errno. As musl's __clone. */
long ib_clone(unsigned long flags, void *stack, int (*fn)(void *), void *arg);
#if defined(__x86_64__)
__asm__(".text\n.hidden ib_clone\n.type ib_clone,@function\nib_clone:\n"
        "  and $-16, %rsi\n  sub $16, %rsi\n  mov %rdx, (%rsi)\n  mov %rcx, 8(%rsi)\n"
        "  xor %edx, %edx\n  xor %r10d, %r10d\n  xor %r8d, %r8d\n  mov $56, %eax\n  syscall\n"
        "  test %rax, %rax\n  jnz 1f\n"
        "  xor %ebp, %ebp\n  pop %rax\n  pop %rdi\n  call *%rax\n  mov %eax, %edi\n  mov $60, %eax\n  syscall\n  hlt\n"
        "1: ret\n");
#elif defined(__aarch64__)
__asm__(".text\n.hidden ib_clone\n.type ib_clone,%function\nib_clone:\n"
        "  and x1, x1, #-16\n  stp x2, x3, [x1, #-16]!\n"
        "  mov x2, #0\n  mov x3, #0\n  mov x4, #0\n  mov x8, #220\n  svc #0\n"
        "  cbz x0, 1f\n  ret\n"
        "1: ldp x1, x0, [sp], #16\n  blr x1\n  mov x8, #93\n  svc #0\n  brk #0\n");
#endif

static int reaper_child(void *arg) {
    struct spawn *s = arg;
    struct sigaction_ dfl = {0, 0, 0, 0}, old;
    long null;
    /* The zygote's handlers (Python's) must not run here, in its memory: default, then its mask back. */
    for (int sig = 1; sig <= 64; sig++)
        if (sig != SIGKILL && sig != 19 && !SYS(rt_sigaction, sig, 0, &old, 8) && old.handler > 1)
            SYS(rt_sigaction, sig, &dfl, 0, 8);
    SYS(rt_sigprocmask, SIG_SETMASK, &s->mask, 0, 8);
    if (s->ready_w == 3 ? SYS(fcntl, 3, F_SETFD, 0) : SYS(dup3, s->ready_w, 3, 0) < 0)
        return 127;
    if ((null = SYS(openat, AT_FDCWD, "/dev/null", O_RDWR)) < 0)
        return 127;
    for (int fd = 0; fd < 3; fd++)
        if (null != fd && SYS(dup3, null, fd, 0) < 0)
            return 127;
    if (null > 3)
        SYS(close, null);
    SYS(execve, s->argv[0], s->argv, s->envp);
    return 127;
}

static long now_us(void) {
    struct __kernel_timespec t;
    SYS(clock_gettime, CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000L + t.tv_nsec / 1000;
}

static long read_file(const char *path, char *buf, long room) {
    long fd = SYS(openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC), got = 0, n = 1;
    if (fd < 0)
        return fd;
    while (got < room && (n = SYS(read, fd, buf + got, room - got)) > 0)
        got += n;
    SYS(close, fd);
    return n < 0 ? n : got < room ? got : -27; /* EFBIG: more than room */
}

/* What a job can change in the shared network namespace and leave behind (zygote.py's docstring), 0.2 ms to
   read: the namespace's counters (a socket outlives its process only where packets went: TIME_WAIT, an
   orphan, which /proc/net/tcp would list at 3.4 ms a read), the unix sockets (one in flight outlives its
   process, and so do the sockets sent in it), the flow labels (they linger). Not sockstat: its counts of
   allocations and memory are the host's, and it counts sockets freed after an RCU grace period. In `buf`:
   each file's length (or -errno: a kernel without IPv6, the same each time) and content. Its length; 0
   where it does not fit (never equal). */
static long net_state(char *buf) {
    static const char *const names[] = {"/proc/self/net/dev", "/proc/self/net/snmp", "/proc/self/net/snmp6",
                                        "/proc/self/net/netstat", "/proc/self/net/unix",
                                        "/proc/self/net/ip6_flowlabel"};
    long at = 0;
    for (int i = 0; i < 6; i++) {
        if (NET_ROOM - at < 8)
            return 0;
        long n = read_file(names[i], buf + at + 8, NET_ROOM - at - 8);
        if (n == -27)
            return 0;
        for (int k = 0; k < 8; k++)
            buf[at + k] = (char)(n >> (8 * k));
        at += 8 + (n > 0 ? n : 0);
    }
    return at;
}

static int same(const char *a, const char *b, long n) {
    for (long i = 0; i < n; i++)
        if (a[i] != b[i])
            return 0;
    return 1;
}

static int proc_top(struct statx *st) {
    return SYS(statx, AT_FDCWD, "/proc", 0, STATX_MODE | STATX_UID | STATX_MTIME | STATX_CTIME, st) ? -1 : 0;
}

static int same_proc_top(void) {
    struct statx st;
    return !proc_top(&st) && st.stx_mtime.tv_sec == loop.proc.stx_mtime.tv_sec &&
           st.stx_mtime.tv_nsec == loop.proc.stx_mtime.tv_nsec && st.stx_ctime.tv_sec == loop.proc.stx_ctime.tv_sec &&
           st.stx_ctime.tv_nsec == loop.proc.stx_ctime.tv_nsec && st.stx_mode == loop.proc.stx_mode &&
           st.stx_uid == loop.proc.stx_uid;
}

static int same_autogroup(void) {
    char now[sizeof loop.autogroup];
    long n = read_file("/proc/self/autogroup", now, sizeof now);
    return n == loop.autogroup_len && (n < 0 || same(now, loop.autogroup, n));
}

/* The answer, JSON (warm.py reads it), built in loop.answer. */
static void put(const char *s) {
    while (*s && loop.answer_len < ANSWER_ROOM - 64)
        loop.answer[loop.answer_len++] = *s++;
}

static void put_long(long v) {
    char digits[24];
    int n = 0;
    unsigned long u = v < 0 ? -(unsigned long)v : (unsigned long)v;
    do
        digits[n++] = '0' + u % 10;
    while (u /= 10);
    if (v < 0)
        put("-");
    while (n)
        loop.answer[loop.answer_len++] = digits[--n];
}

/* Inside a JSON string: printable ASCII as it is but for '"' and '\', every other byte as \u00XX. */
static void put_text(const char *s, long n) {
    static const char hex[] = "0123456789abcdef";
    for (long i = 0; i < n && loop.answer_len < ANSWER_ROOM - 64; i++) {
        unsigned char c = s[i];
        if (c >= ' ' && c <= '~' && c != '"' && c != '\\') {
            loop.answer[loop.answer_len++] = c;
        } else {
            char esc[7] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15], 0};
            put(esc);
        }
    }
}

static int send_answer(void) {
    long r;
    do
        r = SYS(sendto, loop.ctl, loop.answer, loop.answer_len, 0, 0, 0);
    while (r == -4 /* EINTR */);
    return r < 0 ? -1 : 0;
}

/* {"error": TEXT}, or with `err` {"error": "TEXT: errno ERR"} */
static int answer_error(const char *text, long n, long err) {
    loop.answer_len = 0;
    put("{\"error\": \"");
    put_text(text, n);
    if (err) {
        put(": errno ");
        put_long(err);
    }
    put("\"}");
    return send_answer();
}

int ib_net_baseline(void) {
    loop.net_len = net_state(loop.net);
    return loop.net_len ? 0 : 27;
}

int ib_loop_start(int ctl, int keeper, int home, const char *reaper, char *msg, long room) {
    loop.ctl = ctl;
    loop.keeper = keeper;
    loop.home = home;
    for (int i = 0; (loop.reaper_path[i] = reaper[i]); i++) /* the caller's string is its own */
        if (i == sizeof loop.reaper_path - 1)
            return 36; /* ENAMETOOLONG */
    loop.msg = msg;
    loop.room = room;
    loop.cpu = -1;
    loop.cpus_len = SYS(sched_getaffinity, 0, sizeof loop.cpus, loop.cpus);
    loop.autogroup_len = read_file("/proc/self/autogroup", loop.autogroup, sizeof loop.autogroup);
    if (proc_top(&loop.proc))
        return 2; /* ENOENT */
    return ib_net_baseline();
}

/* REAPER up, as pid 1 of the pid namespace just made (the zygote's next child's): its pid, or -errno. */
static long start_reaper(void) {
    int ready[2];
    unsigned long all = ~0UL;
    static char stack[16384] __attribute__((aligned(16)));
    struct spawn s = {-1, {loop.reaper_path, "reap", 0}, {0}, 0};
    long r = SYS(pipe2, ready, O_CLOEXEC), pid;
    if (r)
        return r;
    s.ready_w = ready[1];
    SYS(rt_sigprocmask, SIG_SETMASK, &all, &s.mask, 8);
    pid = ib_clone(CLONE_VM | CLONE_VFORK | SIGCHLD, stack + sizeof stack, reaper_child, &s);
    SYS(rt_sigprocmask, SIG_SETMASK, &s.mask, 0, 8);
    SYS(close, ready[1]);
    if (pid > 0) {
        struct pollfd p = {ready[0], POLLIN, 0};
        struct __kernel_timespec wait = {START_TIMEOUT_MS / 1000, 0};
        char c = 0;
        if (SYS(ppoll, &p, 1, &wait, 0, 8) != 1 || SYS(read, ready[0], &c, 1) != 1 || c != 'r') {
            SYS(kill, pid, SIGKILL);
            SYS(wait4, pid, 0, 0, 0);
            pid = -10; /* ECHILD: it did not start */
        }
    }
    SYS(close, ready[0]);
    return pid;
}

/* The job's CPU, where the caller's thread that sent it was given one (warm.py worker_pool): the zygote moves
   there before it starts REAPER and forks, and both inherit it; a case's two sides then hand over to each
   other on one CPU. A CPU the zygote may not use leaves it where it was. */
static void keep_to(long cpu) {
    if (cpu == loop.cpu || loop.cpus_len <= 0)
        return;
    if (cpu < 0 || cpu >= CPU_BYTES * 8) {
        if (!SYS(sched_setaffinity, 0, loop.cpus_len, loop.cpus))
            loop.cpu = -1;
        return;
    }
    unsigned char one[CPU_BYTES];
    for (int i = 0; i < CPU_BYTES; i++)
        one[i] = i == cpu / 8 ? (unsigned char)(1 << (cpu % 8)) : 0;
    if (!SYS(sched_setaffinity, 0, sizeof one, one))
        loop.cpu = cpu;
}

static long header_field(int k) {
    long v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | (unsigned char)loop.msg[8 * k + i];
    return v;
}

int ib_next(struct ib_job *job) {
    for (;;) {
        char control[64] __attribute__((aligned(8)));
        struct iovec_ iov = {loop.msg, loop.room};
        struct msghdr_ mh = {0, 0, &iov, 1, control, sizeof control, 0};
        long n = SYS(recvmsg, loop.ctl, &mh, MSG_CMSG_CLOEXEC);
        int nfds = 0, fds[8];
        if (n == -4)
            continue;
        for (unsigned long at = 0; n >= 0 && at + sizeof(struct cmsghdr_) <= mh.controllen;) {
            struct cmsghdr_ *c = (struct cmsghdr_ *)(control + at);
            if (c->len < sizeof *c || at + c->len > mh.controllen)
                break;
            if (c->level == SOL_SOCKET && c->type == SCM_RIGHTS)
                for (unsigned long k = 0; k < (c->len - sizeof *c) / 4 && nfds < 8; k++)
                    fds[nfds++] = ((int *)(c + 1))[k];
            at += (c->len + 7) & ~7UL;
        }
        if (n <= 0) {
            for (int i = 0; i < nfds; i++)
                SYS(close, fds[i]);
            return IB_END;
        }
        if (loop.keeper >= 0) { /* the pid keeper puts the namespace's counter back (zygote.py) */
            char c = 0;
            if (SYS(sendto, loop.keeper, "r", 1, 0, 0, 0) != 1 || SYS(recvfrom, loop.keeper, &c, 1, 0, 0, 0) != 1 ||
                c != 'k') {
                for (int i = 0; i < nfds; i++)
                    SYS(close, fds[i]);
                answer_error("its pid keeper is gone", length("its pid keeper is gone"), 0);
                return IB_END;
            }
        }
        long err = 0;
        const char *what = "";
        int failed[2] = {-1, -1};
        if (nfds != 4 || n < HEADER) {
            what = "a job comes with 4 descriptors and its header";
            err = 22;
        } else if ((err = -SYS(pipe2, failed, O_CLOEXEC))) {
            what = "pipe";
        } else if ((err = -SYS(unshare, CLONE_NEWPID))) {
            what = "unshare the job's pid namespace";
        } else {
            keep_to(header_field(1));
            long pid = start_reaper();
            if (pid < 0) {
                err = -pid;
                what = "start its init (REAPER)";
                if (SYS(setns, loop.home, CLONE_NEWPID)) {
                    answer_error(what, length(what), err);
                    return IB_END;
                }
            } else {
                loop.reaper = pid;
                loop.failed_r = failed[0];
                loop.timeout_us = header_field(0);
                job->msg_len = n - HEADER;
                for (int i = 0; i < 4; i++)
                    job->fds[i] = fds[i];
                job->failed_w = failed[1];
                return IB_FORK;
            }
        }
        for (int i = 0; i < nfds; i++)
            SYS(close, fds[i]);
        for (int i = 0; i < 2; i++)
            if (failed[i] >= 0)
                SYS(close, failed[i]);
        if (answer_error(what, length(what), err))
            return IB_END;
    }
}

int ib_answer(const char *retire) {
    if (retire) {
        put(", \"retire\": \"");
        put_text(retire, length(retire));
        put("\"");
    }
    put("}");
    if (send_answer())
        return IB_END;
    return retire ? IB_END : IB_NEXT;
}

int ib_wait(struct ib_job *job, long pid) {
    int home = SYS(setns, loop.home, CLONE_NEWPID) == 0, status = 0, timed_out = 0;
    struct rusage usage;
    long deadline = loop.timeout_us < 0 ? -1 : now_us() + loop.timeout_us;
    char failed[4096];
    long failed_len;
    for (int i = 0; i < 4; i++)
        SYS(close, job->fds[i]);
    SYS(close, job->failed_w);
    usage.ru_maxrss = 0;
    while (pid > 0) {
        unsigned long chld = 1UL << (SIGCHLD - 1);
        long got = SYS(wait4, pid, &status, WNOHANG, &usage), left = 60000000L;
        if (got == pid)
            break;
        if (got < 0 && got != -4) { /* never: the zygote leaves without an answer, as warm.py then assumes */
            SYS(kill, loop.reaper, SIGKILL);
            SYS(wait4, loop.reaper, 0, 0, 0);
            return IB_END;
        }
        if (deadline >= 0 && (left = deadline - now_us()) <= 0) {
            timed_out = 1;
            SYS(kill, loop.reaper, SIGKILL); /* pid 1 of the job's namespace: the whole job */
            SYS(wait4, pid, &status, 0, &usage);
            break;
        }
        if (left > 60000000L)
            left = 60000000L;
        struct __kernel_timespec t = {left / 1000000, left % 1000000 * 1000};
        SYS(rt_sigtimedwait, &chld, 0, &t, 8);
    }
    SYS(kill, loop.reaper, SIGKILL); /* what the job's process left running */
    SYS(wait4, loop.reaper, 0, 0, 0); /* returns once every process of the namespace is gone */
    failed_len = SYS(read, loop.failed_r, failed, sizeof failed);
    SYS(close, loop.failed_r);
    if (pid < 0) {
        answer_error("fork the job's process", length("fork the job's process"), -pid);
        return home ? IB_NEXT : IB_END;
    }
    if (failed_len > 0) {
        answer_error(failed, failed_len, 0);
        return home ? IB_NEXT : IB_END;
    }
    loop.answer_len = 0;
    put("{\"exit_code\": ");
    if ((status & 0x7f) == 0)
        put_long((status >> 8) & 0xff);
    else
        put("null");
    put(", \"signal\": ");
    if ((status & 0x7f) && (status & 0x7f) != 0x7f)
        put_long(status & 0x7f);
    else
        put("null");
    put(timed_out ? ", \"timed_out\": true, \"peak_memory_kb\": " : ", \"timed_out\": false, \"peak_memory_kb\": ");
    put_long(usage.ru_maxrss);
    /* The job reniced the zygote through /proc/ZYGOTE/autogroup (no later job slowed), or set the times of
       the top of its /proc, every job's where it is masked (kernel backend): a count the next job read (red
       team). The zygote's run then ends, and its init with it. */
    const char *retire = !home ? "it could not return to its own pid namespace" :
                         !same_autogroup() ? "a job changed the zygote's scheduling group" :
                         !same_proc_top() ? "a job changed the times of /proc" : 0;
    if (!retire) {
        long n = net_state(loop.now);
        if (!n || n != loop.net_len || !same(loop.now, loop.net, n))
            return IB_NETWORK;
    }
    return ib_answer(retire);
}

