/* image-builder-zygote.so: a warm interpreter's job enters its root, then takes its files, stdio and
 * limits, in two calls (runtime/zygote.py).
 *
 * A zygote's job is a fork of a Python process. Built in Python, a ctypes call per mount, its
 * root cost each job 1.4 ms and 250 copy-on-write faults (40 MBPP tasks one at a time, medians),
 * and its files and limits 0.3-0.6 ms and 60-130 more: every interpreter object a call touches is
 * a page copied. These calls touch their stack and their arguments.
 *
 * Freestanding (no libc: raw system calls, the kernel's own headers), so it loads into whatever
 * interpreter an image has, glibc or musl, old or new, and has no state of its own: it is loaded
 * once by the zygote and called in each job's process, after the fork.
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

static long write_file(const char *path, const char *text) {
    int len = 0;
    while (text[len])
        len++;
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
