/* image-builder-init: pid 1 of a run's sandbox (kernel and userns backends).
 *
 * The holder (runtime/holder.py) starts one with posix_spawn into a new pid
 * namespace, ahead of need; it builds the run's root, then takes jobs from the
 * session on descriptor 3 and answers there. See holder.py for the design.
 *
 * Why C: a run that writes outside /tmp needs a fresh root, so a fresh init. As a fork
 * of the Python holder, an init cost about 3.7 ms of CPU per run on these 2-core
 * VMs: copy-on-write faults on the interpreter's heap, tearing that heap down again,
 * and the interpreter's own work. That was a quarter of a short run. This program is
 * exec'd instead (vfork, nothing to copy) and touches a few pages.
 *
 * Command line (holder.spawn_init):
 *   image-builder-init MODE BASE LOWER USERXATTR NETWORK SCRATCH_MB UPPER CGROUP NETNS_FD
 *                      CONSOLE IDLE_SECONDS [SRC DEST RO]...
 *   MODE: "session": jobs and answers on fd 3, the command's stdio passed with each job;
 *         "joined": one job from fd 3, run on this process's stdin/stdout/stderr in the
 *         caller's session (a shell keeps its terminal); exit with its status;
 *         "sandbox": as "session", but the root is kept from job to job (an agent's
 *         sandbox, runtime/sandbox.py) and jobs run side by side, each answered on a socket
 *         of its own that comes with it: what a job starts in the background keeps running
 *         after it, a timeout kills the job's process group only, as does the client's
 *         shutting or closing its end of the answer's socket (its Ctrl-C, or its death), and
 *         IDLE_SECONDS is the wait for each next job while none runs, not only the first.
 *   "" stands for none, NETNS_FD -1 for none. Paths are the holder's mount namespace's.
 *   image-builder-init netns N: N isolated network namespaces for the holder's pool, each
 *   sent on fd 3 (make_netns).
 *
 * A job (holder.encode_job), little-endian: "IBJ6", u32 nargv, u32 nenv, u32 nfiles,
 * i64 timeout in microseconds (-1: none), i64 memory MB (0: none), i64 max processes,
 * i64 uid and gid to run as (-1: root; a sandbox's only), i64 flags (MAKE_WORKDIR, ZYGOTE), then
 * workdir, argv and env ("K=V") NUL-terminated, then per file: path NUL, u64 length, bytes.
 * Too big for a message: "IBJP" + u64 length, the job in the last fd (after stdin, stdout,
 * stderr and, to a sandbox, the answer's socket).
 * The answer is a marshal dict, which the session loads as is.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define CTL 3
#define CAP_SYS_RESOURCE 24 /* linux/capability.h */
#define MAKE_WORKDIR 1 /* a job's flag: its workdir is the instance's, made where missing */
#define ZYGOTE 2       /* a job's flag: the command is a warm interpreter (zygote.py): pid_keeper() */
#define MAX_MESSAGE (1 << 16)
#define MAX_FDS 8
#define RUN_UMASK 022 /* every run's, as mounts.py RUN_UMASK: main() */

/* The mount API of Linux 5.2 and 5.12 (linux/mount.h, which musl does not ship). */
#define OPEN_TREE_CLONE 1
#define MOVE_MOUNT_F_EMPTY_PATH 0x04
#define MOVE_MOUNT_T_EMPTY_PATH 0x40
#define MOUNT_ATTR_RDONLY 0x1
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#define RESOLVE_NO_MAGICLINKS 0x02 /* linux/openat2.h, which musl's headers lack */
#define PROC_SUPER_MAGIC 0x9fa0
#define CLOSE_RANGE_CLOEXEC 4
#define FSPICK_CLOEXEC 0x1
#define FSPICK_EMPTY_PATH 0x8
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_CMD_RECONFIGURE 7
struct mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

extern char **environ;

struct spec {
    int joined, keep;
    const char *base, *lower, *scratch_mb, *upper, *cgroup, *console;
    int userxattr, network, netns, idle_ms;
    int nbinds;
    char **binds; /* SRC DEST RO, three strings each */
};

struct job {
    int64_t timeout_us, memory_mb, max_processes, uid, gid; /* uid, gid: -1, as this init (root) */
    int64_t flags;
    char *workdir, **argv, **env;
    uint32_t nfiles;
    char *files; /* path NUL, u64 length, bytes; checked by decode_job */
};

struct result {
    int exit_code, sig, timed_out, oom; /* exit_code, sig: -1 none; oom: -1 unknown */
    long long peak_kb;                  /* -1 unknown */
    int start_errno;                    /* why the command could not be started (126, 127), 0: it was */
};

/* The first error of a setup or a job: what the session is told. */
static char error[1024];
static int last_pid = -1; /* this pid namespace's ns_last_pid, open for writing (kernel backend) */
static int keeper = -1;   /* the zygote's end of the pid keeper's socket: its descriptor 3 */
static int user_limits = -1; /* /proc/sys/user as mounted (rw), for no_namespaces() */
static int children = -1; /* a signalfd for SIGCHLD */
/* What the root was built with, ahead of its job, that shows when (O_PATH): made_ahead() stamps them now.
   Of them, /dev/pts's root (its ptmx too) and, on the kernel backend, /proc's (its symlinks too). */
#define MAX_AHEAD 12
static int ahead[MAX_AHEAD], n_ahead, ahead_pts = -1, ahead_proc = -1;

static int fail(const char *fmt, ...) {
    if (!error[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(error, sizeof error, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* --- small files, mounts ------------------------------------------------------------- */

static int write_file(int dirfd, const char *path, const char *text) {
    int fd = openat(dirfd, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return fail("open %s: %s", path, strerror(errno));
    ssize_t n = write(fd, text, strlen(text));
    int e = errno;
    close(fd);
    if (n != (ssize_t)strlen(text))
        return fail("write %s: %s", path, strerror(n < 0 ? e : EIO));
    return 0;
}

/* A small file of /proc or /sys, NUL-terminated; its length, or -1 where there is none. */
static ssize_t read_small(int dirfd, const char *path, char *buf, size_t size) {
    int fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    return n;
}

static int do_mount(const char *src, const char *target, const char *type, unsigned long flags, const char *data) {
    if (mount(src, target, type, flags, data) == 0)
        return 0;
    return fail("mount %s on %s: %s", type ? type : src, target, strerror(errno));
}

/* A read-only remount of a bind mount must repeat these flags; in a user namespace they are locked. */
static int bind_readonly(const char *src, const char *target) {
    static const unsigned long keep[][2] = {{ST_NOSUID, MS_NOSUID},     {ST_NODEV, MS_NODEV},
                                            {ST_NOEXEC, MS_NOEXEC},     {ST_NOATIME, MS_NOATIME},
                                            {ST_NODIRATIME, MS_NODIRATIME}, {ST_RELATIME, MS_RELATIME}};
    struct statvfs st;
    unsigned long flags = MS_REMOUNT | MS_BIND | MS_RDONLY;
    if (do_mount(src, target, NULL, MS_BIND | MS_REC, NULL))
        return -1;
    if (statvfs(target, &st))
        return fail("statvfs %s: %s", target, strerror(errno));
    for (size_t i = 0; i < sizeof keep / sizeof keep[0]; i++)
        if (st.f_flag & keep[i][0])
            flags |= keep[i][1];
    return do_mount(NULL, target, NULL, flags, NULL);
}

/* open(2) that follows no /proc magic link (/proc/self/fd/N, /proc/N/cwd): a path a job names, or
   an image's symlink, must not reach a descriptor this init holds (the run's cgroup directory on
   the host's cgroupfs, the holder's log): a file named /proc/self/fd/10/../../cgroup.procs moved the
   init out of its cgroup, and the init is the host's root in the kernel backend. */
static int open_beneath(int dir, const char *path, int flags, mode_t mode) {
    struct { uint64_t flags, mode, resolve; } how = {(uint64_t)flags, flags & O_CREAT ? mode : 0,
                                                     RESOLVE_NO_MAGICLINKS};
    int fd = syscall(SYS_openat2, dir, path, &how, sizeof how);
    if (fd >= 0 || errno != ENOSYS)
        return fd;
    /* Before Linux 5.6 (no openat2): no symlink is followed at all. */
    char p[PATH_MAX], *save = NULL, *name, *next;
    if (snprintf(p, sizeof p, "%s", path) >= (int)sizeof p)
        return errno = ENAMETOOLONG, -1;
    int at = openat(dir, *p == '/' ? "/" : ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (!(name = strtok_r(p, "/", &save)))
        name = ".";
    while (at >= 0 && (next = strtok_r(NULL, "/", &save))) {
        int sub = openat(at, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(at);
        at = sub;
        name = next;
    }
    if (at < 0)
        return -1;
    fd = openat(at, name, flags | O_NOFOLLOW, mode);
    int e = errno;
    close(at);
    errno = e;
    return fd;
}

/* Each directory of `path` made where missing (0777, less the umask), one component at a time
   (open_beneath: mkdir(2) of a whole path would follow a magic link in it). */
static int mkdirs(const char *path) {
    char p[PATH_MAX], *save = NULL;
    if (snprintf(p, sizeof p, "%s", path) >= (int)sizeof p)
        return fail("path too long: %s", path);
    int dir = open_beneath(AT_FDCWD, *p == '/' ? "/" : ".", O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
    for (char *name = strtok_r(p, "/", &save); dir >= 0 && name; name = strtok_r(NULL, "/", &save)) {
        int next = mkdirat(dir, name, 0777) && errno != EEXIST ? -1 :
                   open_beneath(dir, name, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
        close(dir);
        dir = next;
    }
    if (dir < 0) {
        int e = errno;
        fail("mkdir %s: %s", path, strerror(e));
        errno = e; /* for the caller's message */
        return -1;
    }
    close(dir);
    return 0;
}

/* A run's network without the network: a new namespace has only lo, and it is down (tests still
   use 127.0.0.1). Every address off the host fails at once (ENETUNREACH), but for the ones that
   answer nobody on the internet either (SILENT_NETS: documentation and reserved ranges, and
   10.255.255.1, the address timeout tests dial: requests', urllib3's): routed into lo, where
   nothing takes them, so a connect there times out as it does with a network, and the tests
   that expect a timeout see one (requests' TestTimeout failed offline with "unreachable"). No
   name server is in them, so a name's lookup still fails at once. The same list in zygote.py,
   whose offline_network() the holder's pooled namespaces take too. */
static const struct { const char *net; int bits; } SILENT_NETS[] = {
    {"10.255.255.1", 32}, {"240.0.0.0", 8}, {"192.0.2.0", 24}, {"198.51.100.0", 24}, {"203.0.113.0", 24}};

static int offline_network(void) {
    struct ifreq ifr = {0};
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    strcpy(ifr.ifr_name, "lo");
    ifr.ifr_flags = IFF_UP | IFF_LOOPBACK | IFF_RUNNING;
    if (s < 0 || ioctl(s, SIOCSIFFLAGS, &ifr)) {
        int e = errno;
        if (s >= 0)
            close(s);
        return fail("bring up lo: %s", strerror(e));
    }
    for (size_t i = 0; i < sizeof SILENT_NETS / sizeof *SILENT_NETS; i++) {
        struct rtentry rt = {0};
        struct sockaddr_in *dst = (struct sockaddr_in *)&rt.rt_dst, *mask = (struct sockaddr_in *)&rt.rt_genmask;
        dst->sin_family = mask->sin_family = AF_INET;
        inet_pton(AF_INET, SILENT_NETS[i].net, &dst->sin_addr);
        mask->sin_addr.s_addr = htonl(~0u << (32 - SILENT_NETS[i].bits));
        rt.rt_flags = RTF_UP | (SILENT_NETS[i].bits == 32 ? RTF_HOST : 0);
        rt.rt_dev = "lo";
        /* Best effort: where a kernel refuses, those addresses fail at once like the rest. */
        if (ioctl(s, SIOCADDRT, &rt))
            break;
    }
    close(s);
    return 0;
}

/* "a//b/./c/" -> "a/b/c" into out; -1 for "..", an empty path or one too long. */
static int normalize(const char *path, char *out, size_t size) {
    size_t n = 0;
    for (const char *s = path; *s;) {
        while (*s == '/')
            s++;
        size_t len = strcspn(s, "/");
        if (len == 2 && !strncmp(s, "..", 2))
            return -1;
        if (len && !(len == 1 && *s == '.')) {
            if (n + len + 2 > size)
                return -1;
            if (n)
                out[n++] = '/';
            memcpy(out + n, s, len);
            n += len;
        }
        s += len;
    }
    out[n] = 0;
    return n ? 0 : -1;
}

/* The mount point for a bind at `dest` in the new root (the current directory), made if
   missing (a directory, or an empty file to bind a file on): an O_PATH descriptor. Each
   component is opened without following a symlink, so neither the image's symlinks nor
   one swapped in meanwhile (under an earlier read-write bind, by another run) can lead
   outside; the mount then goes on the descriptor, not on a path looked up again. */
static int open_mountpoint(const char *dest, int is_dir) {
    char path[PATH_MAX];
    if (normalize(dest, path, sizeof path))
        return fail("bad path inside the instance: '%s'; use an absolute path without '..'", dest);
    int dir = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    for (char *name = path;;) {
        char *slash = strchr(name, '/');
        int last = !slash, as_dir = !last || is_dir, fd;
        if (slash)
            *slash = 0;
        int flags = O_PATH | O_NOFOLLOW | O_CLOEXEC | (as_dir ? O_DIRECTORY : 0);
        if ((fd = openat(dir, name, flags)) < 0 && errno == ENOENT) {
            int made = as_dir ? mkdirat(dir, name, 0777) : openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                                                                              O_CLOEXEC, 0644);
            if (made > 0)
                close(made);
            fd = openat(dir, name, flags);
        }
        struct stat st;
        int e = fd < 0 ? errno : 0;
        int link = !(fd < 0 ? fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) : fstat(fd, &st)) && S_ISLNK(st.st_mode);
        close(dir);
        if (fd >= 0 && link)
            close(fd);
        if (fd < 0 || link)
            return link ? fail("/%s is a symlink in the instance; mount on the path it points to instead", path)
                        : fail("cannot make the mount point /%s: %s", path, strerror(e));
        if (last)
            return fd;
        *slash = '/';
        dir = fd;
        name = slash + 1;
    }
}

/* Mount a copy of `src` and of the mounts under it on the descriptor `target`
   (open_tree, move_mount); read-only is set on every mount of the copy. */
static int bind_at(const char *src, int target, int readonly) {
    struct mount_attr rdonly = {.attr_set = MOUNT_ATTR_RDONLY};
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE);
    if (tree < 0)
        return fail("bind %s: %s", src, strerror(errno));
    int r = readonly ? (int)syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &rdonly, sizeof rdonly) : 0;
    if (!r)
        r = (int)syscall(SYS_move_mount, tree, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
    int e = errno;
    close(tree);
    return r ? fail("bind %s%s: %s", src, readonly ? " read-only" : "", strerror(e)) : 0;
}

/* --- the root --------------------------------------------------------------------------- */

/* For the kernel backend, where root inside is host root (runtime.mounts has the same lists,
   for builds). Read-only: what uid 0 may write (runc's readonlyPaths). Masked: host
   information (runc's maskedPaths, docker's /proc/interrupts) and what only uid 0 may read
   (0400: the page-frame tables, slabinfo, vmallocinfo, pagetypeinfo); a file gets /dev/null
   bound over it, a directory an empty read-only one. One bind each, 7-9 us of CPU (a
   missing one: its failed lookup, 1 us); 10 exist here, 2 of the old list did: a fresh
   root as root costs about 75 us more for them (of 0.93 ms). */
static const char *const PROC_READONLY[] = {"sys", "sysrq-trigger", "irq", "bus", "fs"};
static const char *const PROC_MASKED[] = {"acpi", "asound", "kcore", "keys", "latency_stats", "timer_list",
                                          "timer_stats", "sched_debug", "scsi", "kpageflags", "kpagecount",
                                          "kpagecgroup", "interrupts", "slabinfo", "vmallocinfo", "pagetypeinfo"};

/* The tmpfs under the writable layer, /tmp and /dev/shm share the run's memory limit, a
   half, a quarter and a quarter: their pages are memory, which a v2 memory cgroup counts
   but RLIMIT_AS (the limit on v1, as here) does not, so the sizes are the bound. Of each
   share an eighth is for inodes, which size= does not count: an empty file costs about
   1 KB (100,000 of them: 101 MB more slab). Past that a run gets ENOSPC. A session's
   scratch_mb caps each share, and without a limit is each one's size. The job brings the
   limit: finish_root() resizes them. */
#define DEFAULT_SCRATCH_MB 4096 /* the three together, for a run without a memory limit */
enum { LAYER, TMP, SHM };
static const int SCRATCH_PART[3] = {2, 4, 4}; /* the share: 1/2, 1/4, 1/4 of the limit */

/* The size options of each tmpfs for a memory limit (MB, <= 0: none), "size=NNk,nr_inodes=N". */
static void scratch_sizes(const struct spec *s, int64_t memory_mb, char out[3][64]) {
    long long budget = memory_mb > 0 ? (memory_mb < (1LL << 30) ? memory_mb : 1LL << 30) : DEFAULT_SCRATCH_MB;
    long long cap = *s->scratch_mb ? atoll(s->scratch_mb) : 0;
    if (cap > 1LL << 30)
        cap = 1LL << 30;
    for (int i = 0; i < 3; i++) {
        long long kb = (budget << 10) / SCRATCH_PART[i];
        if (cap > 0 && (kb > cap << 10 || memory_mb <= 0))
            kb = cap << 10;
        long long inodes = kb / 8 > 16 ? kb / 8 : 16; /* never 0: that is no limit */
        snprintf(out[i], sizeof out[i], "size=%lldk,nr_inodes=%lld", kb - kb / 8, inodes);
    }
}

/* Docker writes each container an /etc/hosts and apptainer binds the host's: tests that serve on
   "localhost" need the name (sphinx's intersphinx tests, Django's live servers; without it they fail
   with a name-resolution error, which reads as a run that needed the network). A root whose image has
   none (a debootstrap tree, most registry images) gets Docker's, in its writable layer; an image's own
   is kept. Not through a symlink, nor into a directory mounted at /etc. */
#include "hosts.h"

static void default_hosts(void) {
    struct stat root, etc;
    int dir = open("/etc", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), fd = -1;
    if (dir >= 0 && !stat("/", &root) && !fstat(dir, &etc) && root.st_dev == etc.st_dev)
        fd = openat(dir, "hosts", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
        ssize_t n = write(fd, HOSTS, sizeof HOSTS - 1); /* a full layer: the run goes on without the name */
        (void)n;
        close(fd);
    }
    if (dir >= 0)
        close(dir);
}

/* `path` (as the root is being built), kept for made_ahead(); its descriptor, or -1 with error[] set. */
static int keep_ahead(const char *path) {
    int fd = n_ahead == MAX_AHEAD ? (errno = EMFILE, -1) : open(path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return fail("open %s: %s", path, strerror(errno));
    return ahead[n_ahead++] = fd;
}

/* Stamp now what `fd` (made_ahead's) is, or its entry `name`. */
static int touch(int fd, const char *name) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "/proc/self/fd/%d%s%s", fd, name ? "/" : "", name ? name : "");
    if (utimensat(AT_FDCWD, path, NULL, name ? AT_SYMLINK_NOFOLLOW : 0))
        return fail("stamp %s (made with the root): %s", name ? name : "a mount's root", strerror(errno));
    return 0;
}

/* Every entry under the open directory `dir` (closed here) stamped now. */
static int touch_tree(int dir, int depth) {
    DIR *d = fdopendir(dir);
    struct dirent *e;
    int r = d ? 0 : fail("list the writable layer: %s", strerror(errno));
    while (!r && d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (e->d_type == DT_DIR && depth < 64) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            r = sub < 0 ? fail("open %s in the writable layer: %s", e->d_name, strerror(errno))
                        : touch_tree(sub, depth + 1);
        }
        if (!r && utimensat(dirfd(d), e->d_name, NULL, AT_SYMLINK_NOFOLLOW))
            r = fail("stamp %s in the writable layer: %s", e->d_name, strerror(errno));
    }
    if (!r && d && futimens(dirfd(d), NULL))
        r = fail("stamp the writable layer: %s", strerror(errno));
    if (d)
        closedir(d);
    else
        close(dir);
    return r;
}

/* A run's root (one job's, not a sandbox's or a shell's) hides its init from the job (made_ahead). */
static int hides_init(const struct spec *s) { return !s->keep && !s->joined; }

/* A spare init builds its root while the run before it runs (runtime/holder_session.py asks for the
   next as a run starts): what the root was made with showed that time, and a run read how long the one
   before it took, to the millisecond, from /tmp's or /etc/hosts's ctime (red team: 0, 300 and 700 ms
   slept, read back). As its job comes, the init stamps them now: the writable layer's entries (/etc/hosts,
   mount points), the roots of /tmp, /dev/shm and /dev/pts (and ptmx), and /proc's root, the directories
   bound read-only in it and its symlinks. Rootless, /proc's root is not the init's to stamp: a new /proc
   is mounted over it instead (the one under it lets a user namespace mount one). A run's /proc
   (hides_init) has its processes but the command's hidden (hidepid; the init then is not the command's to
   trace): /proc/1's start time and counters were the same clock. A kept layer (shell --persist) keeps its times. */
static int made_ahead(const struct spec *s, int layer) {
    char path[64];
    int r = 0;
    if (!*s->upper && layer >= 0) {
        snprintf(path, sizeof path, "/proc/self/fd/%d/u", layer);
        int dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        r = dir < 0 ? fail("open the writable layer: %s", strerror(errno)) : touch_tree(dir, 0);
    }
    for (int i = 0; !r && i < n_ahead; i++)
        r = touch(ahead[i], NULL);
    if (!r && ahead_pts >= 0)
        r = touch(ahead_pts, "ptmx");
    if (!r && ahead_proc >= 0)
        r = touch(ahead_proc, "self") || touch(ahead_proc, "thread-self");
    for (int i = 0; i < n_ahead; i++)
        close(ahead[i]);
    n_ahead = 0;
    ahead_pts = ahead_proc = -1;
    if (!r && s->userxattr)
        r = do_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, hides_init(s) ? "hidepid=2" : NULL);
    return r;
}

/* As pid 1 of a new pid namespace: build the run's root and move into it; finish_root()
   then ends as root of a nested user namespace that owns nothing: the run can mount,
   unmount or remount nothing (the layers, /proc masks and tmpfs sizes stay put), and real
   root (kernel backend) keeps no capability on the host. Sets descriptors of the run's
   cgroup (the host's /sys is gone afterwards) and of the three tmpfs (opened as mounted: a
   bind over /tmp must not be what finish_root resizes). */
static int enter_root(const struct spec *s, int *cgroup, int scratch_fd[3]) {
    char sizes[3][64], opts[3 * PATH_MAX], path[PATH_MAX], upper[PATH_MAX], work[PATH_MAX];
    struct stat st;
    int isolated = !s->network && s->netns < 0;
    if (unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (isolated ? CLONE_NEWNET : 0)))
        return fail("unshare: %s", strerror(errno));
    if (s->netns >= 0) {
        if (setns(s->netns, CLONE_NEWNET))
            return fail("join the network namespace: %s", strerror(errno));
        close(s->netns);
    } else if (isolated && offline_network())
        return -1;
    if (chdir(s->base))
        return fail("chdir %s: %s", s->base, strerror(errno));
    scratch_sizes(s, 0, sizes);
    snprintf(opts, sizeof opts, "mode=755,%s", sizes[LAYER]);
    if (do_mount("scratch", "s", "tmpfs", MS_NOSUID | MS_NODEV, opts))
        return -1;
    if ((scratch_fd[LAYER] = open("s", O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0)
        return fail("open the scratch tmpfs: %s", strerror(errno));
    if (*s->upper) { /* a kept writable layer (shell --persist) */
        snprintf(upper, sizeof upper, "%s/upper", s->upper);
        snprintf(work, sizeof work, "%s/work", s->upper);
        if (mkdirs(upper) || mkdirs(work))
            return -1;
    } else {
        strcpy(upper, "s/u");
        strcpy(work, "s/w");
        if (mkdir(upper, 0755) || mkdir(work, 0755))
            return fail("mkdir in the scratch tmpfs: %s", strerror(errno));
    }
    if (mkdir("s/r", 0755))
        return fail("mkdir s/r: %s", strerror(errno));
    if (snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s,workdir=%s%s", s->lower, upper, work,
                 s->userxattr ? ",userxattr" : "") >= (int)sizeof opts)
        return fail("overlay options too long");
    /* nodev: a device node in an image must not reach the host's disks; nosuid: nor gain ids. */
    if (do_mount("overlay", "s/r", "overlay", MS_NOSUID | MS_NODEV, opts))
        return -1;
    if (chdir("s/r"))
        return fail("chdir into the root: %s", strerror(errno));
    static const struct { const char *name; mode_t mode; } dirs[] = {{"proc", 0555}, {"dev", 0755}, {"tmp", 01777}};
    for (size_t i = 0; i < 3; i++) {
        if (lstat(dirs[i].name, &st) && (mkdir(dirs[i].name, dirs[i].mode) || chmod(dirs[i].name, dirs[i].mode)))
            return fail("mkdir /%s: %s", dirs[i].name, strerror(errno));
        int fd = open_mountpoint(dirs[i].name, 1); /* the same check as a bind's: no symlink */
        if (fd < 0)
            return -1;
        close(fd);
    }
    snprintf(opts, sizeof opts, "mode=1777,%s", sizes[TMP]);
    if (!*s->upper && (do_mount("tmp", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts) ||
                       (scratch_fd[TMP] = open("tmp", O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0))
        return fail("open /tmp: %s", strerror(errno));
    if (!*s->upper && keep_ahead("tmp") < 0)
        return -1;
    /* A run's (one job's): hidepid (made_ahead says why); gid: the group that sees everything anyway (the
       default, 0, is every job's: root's). Rootless, the /proc mounted over this one at the job has it. */
    if (do_mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                 hides_init(s) && !s->userxattr ? "hidepid=2,gid=65534" : NULL))
        return -1;
    if (!s->userxattr && (ahead_proc = keep_ahead("proc")) < 0)
        return -1;
    /* For no_namespaces(), before /proc/sys is read-only (ENOENT: a kernel without user namespace limits). */
    if ((user_limits = open("proc/sys/user", O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0 && errno != ENOENT)
        return fail("open /proc/sys/user: %s", strerror(errno));
    if (!s->userxattr) { /* root inside is host root: its files there are not for the run */
        char devnull[PATH_MAX], empty[PATH_MAX];
        snprintf(devnull, sizeof devnull, "%s/dev/null", s->base);
        /* An empty directory of the /dev template, read-only in its superblock, so in any bind
           (pts: where each root mounts its own devpts, on its copy of the template). */
        snprintf(empty, sizeof empty, "%s/dev/pts", s->base);
        /* For pid_keeper(), before /proc/sys is made read-only; closed at the first job if not needed. */
        last_pid = open("proc/sys/kernel/ns_last_pid", O_RDWR | O_CLOEXEC);
        for (size_t i = 0; i < sizeof PROC_READONLY / sizeof *PROC_READONLY; i++) {
            snprintf(path, sizeof path, "proc/%s", PROC_READONLY[i]);
            if (!stat(path, &st) && (keep_ahead(path) < 0 || bind_readonly(path, path)))
                return -1;
        }
        for (size_t i = 0; i < sizeof PROC_MASKED / sizeof *PROC_MASKED; i++) {
            snprintf(path, sizeof path, "proc/%s", PROC_MASKED[i]);
            /* Tried, not stat()ed first: most exist. A directory refuses a file (ENOTDIR). */
            if (mount(devnull, path, NULL, MS_BIND, NULL) && errno != ENOENT &&
                (errno != ENOTDIR || mount(empty, path, NULL, MS_BIND, NULL)))
                return fail("mask /proc/%s: %s", PROC_MASKED[i], strerror(errno));
        }
    }
    snprintf(path, sizeof path, "%s/dev", s->base);
    snprintf(opts, sizeof opts, "mode=1777,%s", sizes[SHM]);
    if (do_mount(path, "dev", NULL, MS_BIND | MS_REC, NULL) ||
        do_mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") ||
        do_mount("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts) ||
        (scratch_fd[SHM] = open("dev/shm", O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0)
        return fail("open /dev/shm: %s", strerror(errno));
    if (keep_ahead("dev/shm") < 0 || (ahead_pts = keep_ahead("dev/pts")) < 0)
        return -1;
    if (*s->console && do_mount(s->console, "dev/console", NULL, MS_BIND, NULL))
        return -1;
    for (int i = 0; i < s->nbinds; i++) {
        const char *src = s->binds[3 * i];
        int target = open_mountpoint(s->binds[3 * i + 1], !stat(src, &st) && S_ISDIR(st.st_mode));
        int r = target < 0 ? -1 : bind_at(src, target, !strcmp(s->binds[3 * i + 2], "1"));
        if (target >= 0)
            close(target);
        if (r)
            return -1;
    }
    if (sethostname("sandbox", 7))
        return fail("sethostname: %s", strerror(errno));
    if (*s->cgroup) {
        if ((*cgroup = open(s->cgroup, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
            return fail("open %s: %s", s->cgroup, strerror(errno));
        if (write_file(*cgroup, "cgroup.procs", "0"))
            return -1;
    }
    /* Its cgroups as its root, as a Docker container's (cgroupns private): /proc/self/cgroup showed the
       host's paths, and in them the holder's pid and the run's number among the holder's (rN: on v2,
       how many runs came before). EINVAL: a kernel without cgroup namespaces. */
    if (unshare(CLONE_NEWCGROUP) && errno != EINVAL)
        return fail("unshare the cgroup namespace: %s", strerror(errno));
    /* pivot_root(".", ".") stacks the old root on the new one; detaching it leaves
       nothing of the host in this mount namespace to escape to. */
    if (syscall(SYS_pivot_root, ".", "."))
        return fail("pivot_root: %s", strerror(errno));
    if (umount2(".", MNT_DETACH) || chdir("/"))
        return fail("detach the host's root: %s", strerror(errno));
    default_hosts();
    return 0;
}

/* A sandbox's commands may run as other users (exec's `user`): its user namespace then
   maps, besides root, 65535 uids and gids onto a host range no account uses (systemd's
   range for containers' users), so that no process of the host runs as one of them.
   Only a process left in the parent namespace with CAP_SETUID may write such a map: a
   child of this init, told once the namespace is made. Where that fails (rootless: the
   parent maps no such range) the namespace maps root only, as every run's does. */
#define USERS_BASE 0x6FFF0000 /* the top 64 Ki of systemd's 0x80000-0x6FFFFFFF */
#define USERS 65535

static int own_userns(int more_users) {
    int go[2] = {-1, -1}, mapped = 0, e;
    pid_t helper = -1;
    if (more_users && !pipe2(go, O_CLOEXEC) && (helper = fork()) == 0) {
        char c, map[64];
        snprintf(map, sizeof map, "0 0 1\n1 %d %d\n", USERS_BASE, USERS);
        close(go[1]);
        _exit(read(go[0], &c, 1) == 1 && !write_file(AT_FDCWD, "/proc/1/uid_map", map) &&
              !write_file(AT_FDCWD, "/proc/1/gid_map", map) ? 0 : 1);
    }
    if (go[0] >= 0)
        close(go[0]);
    e = unshare(CLONE_NEWUSER) ? errno : 0;
    if (helper > 0) {
        int status = 0;
        if (!e && write(go[1], "x", 1) != 1)
            e = errno;
        close(go[1]);
        while (waitpid(helper, &status, 0) < 0 && errno == EINTR)
            ;
        mapped = !e && WIFEXITED(status) && !WEXITSTATUS(status);
    } else if (go[1] >= 0)
        close(go[1]);
    if (e)
        return fail("unshare the user namespace: %s", strerror(e));
    if (mapped)
        return 0;
    return write_file(AT_FDCWD, "/proc/self/setgroups", "deny") || write_file(AT_FDCWD, "/proc/self/uid_map", "0 0 1") ||
           write_file(AT_FDCWD, "/proc/self/gid_map", "0 0 1") ? -1 : 0;
}

/* A run makes no namespace of its own (its user namespace's limits, which it cannot raise). With them, a
   case moved counters every process of the host shares: each new network namespace takes the next
   cookie (SO_NETNS_COOKIE) and each mount the next unique id (statx), while its root's namespace and
   mounts were made ahead, before the case before it ran: 10,000 namespaces made by one case were
   there for the next to count. A warm interpreter makes its jobs' namespaces (a job's namespaces and
   mounts are all made as it starts: nothing older to count from); a sandbox (an agent's) and a shell
   keep them. ENOENT: a kernel without these limits. Root of this user namespace may raise its limits
   with CAP_SYS_RESOURCE there (rootless, /proc/sys is writable): the run's bounding set loses it (it
   grants nothing else in a user namespace: raising a hard rlimit takes it in the host's). */
static int no_namespaces(void) {
    static const char *const limits[] = {"max_user_namespaces", "max_net_namespaces", "max_mnt_namespaces",
                                         "max_pid_namespaces", "max_ipc_namespaces", "max_uts_namespaces",
                                         "max_cgroup_namespaces", "max_time_namespaces"};
    for (size_t i = 0; i < sizeof limits / sizeof *limits; i++) {
        if (user_limits < 0 || (faccessat(user_limits, limits[i], F_OK, 0) && errno == ENOENT))
            continue;
        if (write_file(user_limits, limits[i], "0\n"))
            return -1;
    }
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0))
        return fail("drop CAP_SYS_RESOURCE: %s", strerror(errno));
    return 0;
}

/* The rest, at the first job (it brings the memory limit): size the three tmpfs for it
   (scratch_sizes) while this init still may, then drop into a nested user namespace that
   owns nothing. A sandbox's later jobs get the limit of its first, so this is done once.
   Resizing a detached mount takes fspick (mount(2) wants it
   in this namespace): about 7 us a tmpfs, and only where the size changes. */
static int finish_root(const struct spec *s, const struct job *j, const int scratch_fd[3]) {
    char before[3][64], sizes[3][64];
    scratch_sizes(s, 0, before);
    scratch_sizes(s, j->memory_mb, sizes);
    for (int i = 0; i < 3; i++) {
        if (!strcmp(before[i], sizes[i]) || scratch_fd[i] < 0) /* -1: a kept layer's /tmp, in it */
            continue;
        int fc = (int)syscall(SYS_fspick, scratch_fd[i], "", FSPICK_EMPTY_PATH | FSPICK_CLOEXEC);
        int r = fc < 0 ? -1 : 0;
        for (char *opt = sizes[i], *next; !r && opt; opt = next) {
            char *eq = strchr(opt, '=');
            if ((next = strchr(opt, ',')))
                *next++ = 0;
            *eq = 0;
            r = (int)syscall(SYS_fsconfig, fc, FSCONFIG_SET_STRING, opt, eq + 1, 0);
        }
        if (!r)
            r = (int)syscall(SYS_fsconfig, fc, FSCONFIG_CMD_RECONFIGURE, NULL, NULL, 0);
        int e = errno;
        if (fc >= 0)
            close(fc);
        if (r)
            return fail("size the %s tmpfs for the memory limit: %s", i == LAYER ? "writable layer's" : i == TMP ?
                        "/tmp" : "/dev/shm", strerror(e));
    }
    if (own_userns(s->keep) || (!s->keep && !s->joined && !(j->flags & ZYGOTE) && no_namespaces()))
        return -1;
    /* Inherited by the command: in any out-of-memory kill, on the host or in a cgroup, a
       run goes first (and of a run, its biggest process: the command, not this init). */
    return write_file(AT_FDCWD, "/proc/self/oom_score_adj", "1000");
}

/* --- a job ---------------------------------------------------------------------------------- */

/* n NUL-terminated strings at *at, into out[] (if given) */
static int take_strings(char **at, char *end, char **out, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        char *nul = memchr(*at, 0, end - *at);
        if (!nul)
            return -1;
        if (out)
            out[i] = *at;
        *at = nul + 1;
    }
    return 0;
}

/* Check and index a job's bytes (kept in `data`, which the job points into). */
static int decode_job(char *data, size_t len, struct job *j) {
    uint32_t counts[3];
    char *at = data + 64, *end = data + len;
    if (len < 64 || memcmp(data, "IBJ6", 4))
        return fail("bad job message (image-builder versions mixed? restart the holder)");
    memcpy(counts, data + 4, sizeof counts);
    memcpy(&j->timeout_us, data + 16, 8);
    memcpy(&j->memory_mb, data + 24, 8);
    memcpy(&j->max_processes, data + 32, 8);
    memcpy(&j->uid, data + 40, 8);
    memcpy(&j->gid, data + 48, 8);
    memcpy(&j->flags, data + 56, 8);
    if (counts[0] < 1 || counts[0] > len || counts[1] > len || counts[2] > len)
        return fail("bad job message: counts");
    j->argv = calloc(counts[0] + 1, sizeof(char *));
    j->env = calloc(counts[1] + 1, sizeof(char *));
    if (!j->argv || !j->env || take_strings(&at, end, &j->workdir, 1) || take_strings(&at, end, j->argv, counts[0]) ||
        take_strings(&at, end, j->env, counts[1]))
        return fail("bad job message: strings");
    j->nfiles = counts[2];
    j->files = at;
    for (uint32_t i = 0; i < j->nfiles; i++) {
        uint64_t size;
        if (take_strings(&at, end, NULL, 1) || (size_t)(end - at) < 8)
            return fail("bad job message: files");
        memcpy(&size, at, 8);
        if (size > (uint64_t)(end - at - 8))
            return fail("bad job message: file size");
        at += 8 + size;
    }
    return 0;
}

/* Into the run's writable layer, after pivot_root: the image's symlinks lead nowhere
   but inside, so they are followed as the command would, but no /proc magic link
   (open_beneath), and no file of /proc is written (the init's own: /proc/self/...). */
static int write_files(const struct job *j) {
    char *at = j->files;
    for (uint32_t i = 0; i < j->nfiles; i++) {
        char *path = at, *slash = strrchr(path, '/');
        uint64_t size;
        at += strlen(path) + 1;
        memcpy(&size, at, 8);
        at += 8;
        if (path[0] != '/')
            return fail("file path '%s' must be absolute", path);
        if (slash != path) {
            *slash = 0;
            int r = mkdirs(path);
            *slash = '/';
            if (r)
                return -1;
        }
        /* Non-blocking: a fifo in the image must not hang the init (nor anything but a file take the data). */
        struct stat st;
        struct statfs fs;
        int fd = open_beneath(AT_FDCWD, path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0644);
        if (fd >= 0 && (fstat(fd, &st) || !S_ISREG(st.st_mode) || fstatfs(fd, &fs) || fs.f_type == PROC_SUPER_MAGIC)) {
            close(fd);
            fd = -1;
            errno = EEXIST;
        }
        if (fd < 0)
            return fail("cannot write %s: %s", path, errno == EEXIST || errno == ENXIO ? "not a regular file in the "
                        "instance" : strerror(errno));
        for (uint64_t done = 0; done < size;) {
            ssize_t n = write(fd, at + done, size - done);
            if (n < 0) {
                close(fd);
                return fail("cannot write %s: %s", path, strerror(errno));
            }
            done += n;
        }
        close(fd);
        at += size;
    }
    return 0;
}

static int chdir_beneath(const char *path) {
    int fd = open_beneath(AT_FDCWD, path, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
    int r = fd < 0 ? -1 : fchdir(fd), e = errno;
    if (fd >= 0)
        close(fd);
    errno = e;
    return r;
}

/* Into the job's workdir. The instance's own, where the instance lacks it (a catalog's /task
   for tasks that add no files), is made empty in the run's writable layer, as Docker makes a
   missing WORKDIR; any other must exist (a sandbox exec's cwd, as `docker exec -w`). */
static int enter_workdir(const struct job *j) {
    if (!chdir_beneath(j->workdir))
        return 0;
    int e = errno;
    if (e == ENOENT && (j->flags & MAKE_WORKDIR)) {
        if (!mkdirs(j->workdir) && !chdir_beneath(j->workdir))
            return 0;
        e = errno;
        error[0] = 0; /* mkdirs' own message: this one says what to do */
        return fail("workdir %s is not in the instance and cannot be made: %s", j->workdir,
                    e == EROFS ? "it would be on a read-only file system (no writable layer there); give a "
                                 "workdir that exists" : strerror(e));
    }
    return fail("workdir %s: %s; pass a directory that exists in the instance", j->workdir, strerror(e));
}

static const char *getenv_in(char **env, const char *name) {
    size_t n = strlen(name);
    for (; *env; env++)
        if (!strncmp(*env, name, n) && (*env)[n] == '=')
            return *env + n + 1;
    return "";
}

/* The program to run, looked up in the job's PATH (not ours); 0, or ENOENT. */
static int which(const char *name, const char *path, char *out, size_t size) {
    struct stat st;
    if (strchr(name, '/'))
        return snprintf(out, size, "%s", name) < (int)size ? 0 : ENAMETOOLONG;
    for (const char *d = path;; d++) {
        size_t len = strcspn(d, ":");
        if (snprintf(out, size, "%.*s/%s", (int)(len ? len : 1), len ? d : ".", name) < (int)size && !stat(out, &st) &&
            S_ISREG(st.st_mode) && !access(out, X_OK))
            return 0;
        d += len;
        if (!*d)
            return ENOENT;
    }
}

/* Limits in the run's cgroup (v2: memory and pids; v1: pids); whether memory is limited there. */
static int cgroup_limits(int cg, const struct job *j, int *memory_in_cgroup) {
    char text[64], old[64];
    snprintf(text, sizeof text, "%lld", (long long)j->max_processes);
    *memory_in_cgroup = 0;
    if (write_file(cg, "pids.max", text))
        return -1;
    if (read_small(cg, "memory.max", old, sizeof old) <= 0)
        return 0;
    if (j->memory_mb)
        snprintf(text, sizeof text, "%lld", (long long)j->memory_mb << 20);
    if (write_file(cg, "memory.max", j->memory_mb ? text : "max"))
        return -1;
    if (read_small(cg, "memory.swap.max", old, sizeof old) > 0 &&  /* absent without swap accounting */
        write_file(cg, "memory.swap.max", j->memory_mb ? "0" : "max"))
        return -1;
    *memory_in_cgroup = 1;
    return 0;
}

/* Killed for memory, and peak memory, from a v2 cgroup; unknown (-1) on v1. */
static void cgroup_verdict(int cg, struct result *r) {
    char text[1024];
    if (read_small(cg, "memory.events", text, sizeof text) <= 0)
        return;
    char *kills = strstr(text, "oom_kill ");
    r->oom = kills && atoll(kills + 9) > 0;
    if (read_small(cg, "memory.peak", text, sizeof text) > 0 && text[0] >= '0' && text[0] <= '9')
        r->peak_kb = atoll(text) / 1024;
}

static int64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* From pid 1: kill every other process of the run (double forks and daemons too) and
   reap them, so none outlives its run or holds its output open. */
static void end_all(void) {
    if (kill(-1, SIGKILL) && errno == ESRCH)
        return;
    while (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
        ;
}

/* Start `exe` as the job's uid and gid (posix_spawn cannot change them): fork, then the
   user and the exec; a failure of either comes back through a close-on-exec pipe. 0 with
   *pid, or the errno (*as_user: it was the change of user that failed). */
static int spawn_as(const struct job *j, const char *exe, const int stdio[3], pid_t *pid, int *as_user) {
    int report[2], got[2] = {0, 0};
    if (pipe2(report, O_CLOEXEC))
        return errno;
    pid_t p = fork();
    if (p < 0) {
        int e = errno;
        close(report[0]);
        close(report[1]);
        return e;
    }
    if (p == 0) {
        gid_t gid = (gid_t)j->gid;
        sigset_t none;
        int why[2] = {1, 0};
        sigemptyset(&none);
        signal(SIGPIPE, SIG_DFL);
        if (setsid() < 0 || dup2(stdio[0], 0) < 0 || dup2(stdio[1], 1) < 0 || dup2(stdio[2], 2) < 0 ||
            setgroups(1, &gid) || setgid(gid) || setuid((uid_t)j->uid))
            why[1] = errno;
        else {
            sigprocmask(SIG_SETMASK, &none, NULL);
            execve(exe, j->argv, j->env);
            why[0] = 0;
            why[1] = errno;
        }
        (void)!write(report[1], why, sizeof why);
        _exit(127);
    }
    close(report[1]);
    ssize_t n;
    while ((n = read(report[0], got, sizeof got)) < 0 && errno == EINTR)
        ;
    close(report[0]);
    if (n == (ssize_t)sizeof got) {
        while (waitpid(p, NULL, 0) < 0 && errno == EINTR)
            ;
        *as_user = got[0];
        return got[1] ? got[1] : EIO;
    }
    *pid = p;
    return 0;
}

/* Start a job's command: its files, workdir and limits, then the command, in a session of
   its own unless joined; the command's stdio are closed here once passed on. 0 with *pid
   (0 when the command could not be started: r->exit_code is 126 or 127, the reason went to
   its stderr); -1: error[] says why, and the stdio are the caller's to close. */
static int start_job(const struct spec *s, const struct job *j, const int stdio[3], int cgroup, pid_t *pid,
                     struct result *r) {
    char exe[PATH_MAX];
    int memory_in_cgroup = 0, e, as_user = 0;
    *pid = 0;
    *r = (struct result){-1, -1, 0, -1, -1, 0};
    if (write_files(j) || enter_workdir(j))
        return -1;
    struct rlimit none = {0, 0}, procs = {j->max_processes, j->max_processes},
                  mem = {j->memory_mb << 20, j->memory_mb << 20};
    if (cgroup >= 0 && cgroup_limits(cgroup, j, &memory_in_cgroup))
        return -1;
    /* Limits on this init are inherited by the command; RLIMIT_NPROC counts per user
       namespace, so per run (but never for host root: there the pids cgroup does it).
       They cannot be raised again: a sandbox's jobs all have its first's. */
    if (setrlimit(RLIMIT_CORE, &none) || (cgroup < 0 && setrlimit(RLIMIT_NPROC, &procs)) ||
        (j->memory_mb && !memory_in_cgroup && setrlimit(RLIMIT_AS, &mem)))
        return fail("cannot set the run's limits: %s", strerror(errno));
    if (!(e = which(j->argv[0], getenv_in(j->env, "PATH"), exe, sizeof exe)) && (j->uid > 0 || j->gid > 0))
        e = spawn_as(j, exe, stdio, pid, &as_user);
    else if (!e) {
        posix_spawn_file_actions_t fa;
        posix_spawnattr_t at;
        sigset_t all, empty;
        sigfillset(&all);
        sigemptyset(&empty);
        posix_spawn_file_actions_init(&fa);
        if (!s->joined)
            for (int i = 0; i < 3; i++)
                posix_spawn_file_actions_adddup2(&fa, stdio[i], i);
        if (keeper >= 0)
            posix_spawn_file_actions_adddup2(&fa, keeper, 3);
        posix_spawnattr_init(&at);
        posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK |
                                          (s->joined ? 0 : POSIX_SPAWN_SETSID));
        posix_spawnattr_setsigdefault(&at, &all);
        posix_spawnattr_setsigmask(&at, &empty);
        e = posix_spawn(pid, exe, &fa, &at, j->argv, j->env);
        posix_spawn_file_actions_destroy(&fa);
        posix_spawnattr_destroy(&at);
    }
    if (e) {
        *pid = 0;
        if (as_user)
            dprintf(stdio[2], "image-builder: cannot run as uid %lld, gid %lld: %s\n", (long long)j->uid,
                    (long long)j->gid, strerror(e));
        else
            dprintf(s->joined ? 2 : stdio[2], "image-builder: cannot run '%s': %s\n", j->argv[0],
                    e == ENOENT ? "command not found" : strerror(e));
        r->exit_code = e == ENOENT && !as_user ? 127 : 126;
        r->start_errno = e;
    }
    if (!s->joined)
        for (int i = 0; i < 3; i++) /* the command has them: their EOF must not wait for this init */
            close(stdio[i]);
    if (keeper >= 0)
        close(keeper);
    return 0;
}

/* How a command that ended with `status` did. */
static void job_result(int status, const struct rusage *ru, int cgroup, struct result *r) {
    if (WIFEXITED(status))
        r->exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        r->sig = WTERMSIG(status);
    r->peak_kb = ru->ru_maxrss;
    if (cgroup >= 0)
        cgroup_verdict(cgroup, r);
}

/* As pid 1 of the run: start the command and wait for it; on timeout kill every process
   here. 0: done; 1: the session went away (every process killed, nobody to tell);
   -1: error[] says why the command could not be started. */
static int run_job(const struct spec *s, const struct job *j, const int stdio[3], int cgroup, struct result *r) {
    pid_t pid;
    if (start_job(s, j, stdio, cgroup, &pid, r))
        return -1;
    if (!pid)
        return 0;
    struct pollfd fds[2] = {{children, POLLIN, 0}, {CTL, POLLIN, 0}};
    int64_t deadline = j->timeout_us < 0 ? -1 : now_us() + j->timeout_us;
    int status = 0, done = 0;
    struct rusage ru = {0};
    while (!done) {
        int64_t left = deadline < 0 ? -1 : deadline - now_us();
        int wait = deadline < 0 ? -1 : left <= 0 ? 0 : left / 1000 + 1 > INT_MAX ? INT_MAX : (int)(left / 1000 + 1);
        int n = poll(fds, s->joined ? 1 : 2, wait);
        if (n < 0 && errno == EINTR)
            continue;
        if (n > 0 && fds[1].revents) { /* the session sends nothing while a job runs: readable means gone */
            kill(-1, SIGKILL);
            return 1;
        }
        if (n > 0) { /* reap every child that ended: the command, or orphans it left to pid 1 */
            struct signalfd_siginfo info;
            while (read(children, &info, sizeof info) > 0)
                ;
            struct rusage one;
            for (pid_t p; (p = wait4(-1, &status, WNOHANG, &one)) > 0;)
                if (p == pid) {
                    done = 1;
                    ru = one;
                    break;
                }
        } else if (deadline >= 0 && now_us() >= deadline) {
            kill(-1, SIGKILL); /* from pid 1: every process of this pid namespace */
            r->timed_out = 1;
            while (wait4(pid, &status, 0, &ru) < 0 && errno == EINTR)
                ;
            done = 1;
        }
    }
    end_all();
    job_result(status, &ru, cgroup, r);
    return 0;
}

/* --- answers (marshal, as the session's recv_fds loads them) ------------------------------- */

struct answer {
    char data[2048];
    size_t len;
};

static void m_key(struct answer *a, const char *key) {
    size_t n = strlen(key);
    a->data[a->len++] = 'z'; /* TYPE_SHORT_ASCII */
    a->data[a->len++] = (char)n;
    memcpy(a->data + a->len, key, n);
    a->len += n;
}

static void m_int(struct answer *a, const char *key, long long v, int none) {
    int32_t i = v > INT32_MAX ? INT32_MAX : (int32_t)v;
    m_key(a, key);
    if (none) {
        a->data[a->len++] = 'N';
        return;
    }
    a->data[a->len++] = 'i';
    memcpy(a->data + a->len, &i, 4);
    a->len += 4;
}

static void m_bool(struct answer *a, const char *key, int v) { /* -1: None */
    m_key(a, key);
    a->data[a->len++] = v < 0 ? 'N' : v ? 'T' : 'F';
}

static int send_answer(int fd, struct answer *a) {
    a->data[a->len++] = '0'; /* the dict's end */
    return send(fd, a->data, a->len, MSG_NOSIGNAL) == (ssize_t)a->len ? 0 : -1;
}

static int send_result(int fd, const struct result *r) {
    struct answer a = {.data = "{", .len = 1};
    m_int(&a, "exit_code", r->exit_code, r->exit_code < 0);
    m_int(&a, "signal", r->sig, r->sig < 0);
    m_bool(&a, "timed_out", r->timed_out);
    m_int(&a, "peak_memory_kb", r->peak_kb, r->peak_kb < 0);
    m_bool(&a, "out_of_memory", r->oom);
    m_int(&a, "start_errno", r->start_errno, !r->start_errno);
    return send_answer(fd, &a);
}

static void send_error(int fd) {
    struct answer a = {.data = "{", .len = 1};
    size_t n = strlen(error);
    int32_t len = (int32_t)n;
    m_key(&a, "error");
    a.data[a.len++] = 'u';
    memcpy(a.data + a.len, &len, 4);
    a.len += 4;
    for (size_t i = 0; i < n; i++) /* valid UTF-8 whatever a path held */
        a.data[a.len++] = (unsigned char)error[i] < 0x80 ? error[i] : '?';
    send_answer(fd, &a);
}

/* --- the job loop ----------------------------------------------------------------------------- */

/* One job message: its bytes (inline, or from the memfd a big job comes in) with the
   command's stdin, stdout and stderr and, to a sandbox, the socket its answer goes to.
   0, 1 at EOF, -1 on a bad message. */
static int read_message(const struct spec *s, char **data, size_t *len, int *owned, int stdio[3], int *answer) {
    static char message[MAX_MESSAGE];
    char control[CMSG_SPACE(MAX_FDS * sizeof(int))];
    int fds[MAX_FDS], nfds = 0;
    struct iovec iov = {message, sizeof message};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    ssize_t n = recvmsg(CTL, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0)
        return 1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            memcpy(fds, CMSG_DATA(c), nfds * sizeof(int));
        }
    int big = n == 12 && !memcmp(message, "IBJP", 4), used = (s->joined ? 0 : 3) + s->keep + big;
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || nfds < used) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        return fail("bad job message: truncated, or descriptors missing");
    }
    for (int i = used; i < nfds; i++) /* more than a job comes with */
        close(fds[i]);
    for (int i = 0; i < 3; i++)
        stdio[i] = s->joined ? i : fds[i];
    if (s->keep)
        *answer = fds[3];
    if (big) {
        uint64_t size;
        int payload = fds[used - 1], e = 0;
        memcpy(&size, message + 4, 8);
        errno = 0; /* a short read sets none */
        if (!(*data = malloc(size ? size : 1)) || pread(payload, *data, size, 0) != (ssize_t)size)
            e = errno ? errno : EIO;
        close(payload);
        *len = size;
        *owned = *data != NULL;
        return e ? fail("cannot read the job: %s", strerror(e)) : 0;
    }
    *data = message;
    *len = n;
    return 0;
}

/* The session's job, within the idle time of a spare nobody used (a session kept open
   holds nothing for long); as read_message. */
static int receive(const struct spec *s, char **data, size_t *len, int *owned, int stdio[3]) {
    struct pollfd p = {CTL, POLLIN, 0};
    if (!s->joined && poll(&p, 1, s->idle_ms) <= 0)
        return 1;
    return read_message(s, data, len, owned, stdio, NULL);
}

/* A warm interpreter (zygote.py) clones each of its jobs into a pid namespace under this one,
   and on the kernel backend its jobs can only have this namespace's /proc (a masked /proc
   cannot be mounted again from a user namespace). There a job saw every process of the run,
   the zygote's fault and CPU counters growing with each job, and its own pids, advancing with
   earlier jobs' forks: counts of the cases before it (red team: 184 faults, 2 pids a job).
   So this /proc hides what a job may not trace (hidepid, as every run's: the zygote, this init, the
   keeper), and a keeper, forked before this init gives up its privileges over the namespace, puts its
   pid counter back, when the zygote asks before each job, to what it was at the first ask:
   each job then gets the same pids. It does nothing else and is told nothing else (one byte
   each way on the socket it shares with the zygote, the command's descriptor 3). On the
   rootless backend each job mounts a /proc of its own: nothing to do. -1 with error[] set. */
static int pid_keeper(void) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair))
        return fail("socketpair: %s", strerror(errno));
    pid_t p = fork();
    if (p < 0)
        return fail("fork the pid keeper: %s", strerror(errno));
    if (p == 0) {
        char base[32], c;
        ssize_t len = -1;
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        prctl(PR_SET_DUMPABLE, 0);
        if (dup2(pair[1], 0) < 0 || dup2(last_pid, 1) < 0 || syscall(SYS_close_range, 2, ~0U, 0))
            _exit(1);
        while (read(0, &c, 1) == 1) {
            int ok = len < 0 ? (len = pread(1, base, sizeof base, 0)) > 0 : pwrite(1, base, len, 0) == len;
            if (write(0, ok ? "k" : "e", 1) != 1)
                break;
        }
        _exit(0);
    }
    close(pair[1]);
    keeper = pair[0];
    return 0;
}

/* The rest of the root, at the first job (finish_root); then this init is made
   non-dumpable. 0, or -1 with error[] set. */
static int first_job(const struct spec *s, const struct job *j, int scratch[3]) {
    /* A scheduler autogroup of its own (a run renicing /proc/1/autogroup then slows this init alone), made
       now: one made with the init, ahead of need, was a baseline the job read its own against (the count of
       sessions made on the host meanwhile, by the run before too: any number it chose to leave). */
    if (setsid() < 0)
        return fail("setsid: %s", strerror(errno));
    if (made_ahead(s, scratch[LAYER]))
        return -1;
    if ((j->flags & ZYGOTE) && last_pid >= 0 && pid_keeper())
        return -1;
    if (last_pid >= 0)
        close(last_pid);
    int r = finish_root(s, j, scratch);
    if (user_limits >= 0)
        close(user_limits);
    if (r)
        return -1;
    for (int i = 0; i < 3; i++)
        if (scratch[i] >= 0)
            close(scratch[i]);
    /* The command runs as the same uid as this init: it could ptrace the init (or read
       /proc/1/fd) and forge the answer. Non-dumpable, the init can only be traced with
       CAP_SYS_PTRACE in the namespace its memory was made in: the host's. (Not before
       finish_root: its own /proc files become root's, uid_map included.) */
    prctl(PR_SET_DUMPABLE, 0);
    return 0;
}

/* --- a sandbox: its root kept, its jobs side by side ------------------------------------- */

/* Jobs run at once: Inspect runs an agent's parallel tool calls together, and one call may
   wait in the foreground for a server another call starts. Each job comes with the socket
   its answer goes to, so answers need no sorting out at the client, and a client that
   gives up on its job (Ctrl-C, or killed) says so by shutting that socket: the job's
   process group is killed. */
#define MAX_JOBS 64

struct running {
    pid_t pid;
    int answer, timed_out, killed; /* killed: its process group, at its timeout or its client's going */
    int64_t deadline; /* now_us()'s, -1 for none */
};

/* Take a job: build the rest of the root at the first, start its command, or answer its
   error. Whether the sandbox can go on (not when its root could not be built). */
static int take_job(const struct spec *s, int setup, int cgroup, int scratch[3], int *finished,
                    int64_t *sized_for, struct running *jobs, int *njobs) {
    char *data = NULL;
    size_t len = 0;
    int stdio[3] = {-1, -1, -1}, answer = -1, owned = 0, ok;
    struct job j = {0};
    struct result r;
    pid_t pid = 0;
    int got = read_message(s, &data, &len, &owned, stdio, &answer);
    if (got == 1)
        return 0;
    ok = !got && !setup && !decode_job(data, len, &j);
    if (ok && !*finished) {
        ok = !first_job(s, &j, scratch);
        *finished = ok;
        *sized_for = j.memory_mb;
    } else if (ok && j.memory_mb != *sized_for) /* its tmpfs are sized once */
        ok = !fail("this sandbox's tmpfs are sized for a memory limit of %lld MB, not %lld", (long long)*sized_for,
                   (long long)j.memory_mb);
    if (ok && *njobs == MAX_JOBS)
        ok = !fail("%d commands run in this sandbox already; wait for one to end", MAX_JOBS);
    if (ok && !start_job(s, &j, stdio, cgroup, &pid, &r)) {
        if (pid) {
            jobs[(*njobs)++] = (struct running){pid, answer, 0, 0,
                                                j.timeout_us < 0 ? -1 : now_us() + j.timeout_us};
            answer = -1;
        } else
            send_result(answer, &r);
    } else {
        send_error(answer);
        for (int i = 0; i < 3; i++) /* start_job had not passed them on */
            if (stdio[i] >= 0)
                close(stdio[i]);
    }
    error[0] = 0;
    if (answer >= 0)
        close(answer);
    free(j.argv);
    free(j.env);
    if (owned)
        free(data);
    return *finished;
}

/* Until the session hangs up, or no job comes for the idle time: then every process of
   the sandbox ends with this init (pid 1). What a job leaves in the background runs on
   and is reaped as it ends; a job's timeout kills its process group only. */
static int serve_sandbox(const struct spec *s, int setup, int cgroup, int scratch[3]) {
    struct running jobs[MAX_JOBS];
    struct pollfd p[2 + MAX_JOBS];
    int njobs = 0, finished = 0;
    int64_t sized_for = 0, idle_until = now_us() + (int64_t)s->idle_ms * 1000;
    for (;;) {
        int64_t now = now_us(), next = njobs ? -1 : idle_until;
        p[0] = (struct pollfd){CTL, POLLIN, 0};
        p[1] = (struct pollfd){children, POLLIN, 0};
        for (int i = 0; i < njobs; i++) { /* a client's end of the answer's socket: shut means given up */
            p[2 + i] = (struct pollfd){jobs[i].killed ? -1 : jobs[i].answer, POLLIN, 0};
            if (jobs[i].deadline >= 0 && !jobs[i].killed && (next < 0 || jobs[i].deadline < next))
                next = jobs[i].deadline;
        }
        int wait = next < 0 ? -1 : next <= now ? 0 : (next - now) / 1000 + 1 > INT_MAX ? INT_MAX
                                                                                    : (int)((next - now) / 1000 + 1);
        if (poll(p, 2 + njobs, wait) < 0 && errno != EINTR)
            break;
        now = now_us();
        for (int i = 0; i < njobs; i++) {
            int late = jobs[i].deadline >= 0 && now >= jobs[i].deadline;
            if (!jobs[i].killed && (p[2 + i].revents || late)) {
                kill(-jobs[i].pid, SIGKILL); /* its setsid session: what earlier jobs left runs on */
                jobs[i].killed = 1;
                jobs[i].timed_out = late && !p[2 + i].revents;
            }
        }
        if (p[0].revents & (POLLHUP | POLLERR)) /* every holder of the socket is gone */
            break;
        if (p[0].revents & POLLIN) {
            if (!take_job(s, setup, cgroup, scratch, &finished, &sized_for, jobs, &njobs))
                break;
            idle_until = now_us() + (int64_t)s->idle_ms * 1000;
        }
        if (p[1].revents) { /* reap every child that ended: a job's command, or an orphan */
            struct signalfd_siginfo info;
            struct rusage ru;
            int status;
            while (read(children, &info, sizeof info) > 0)
                ;
            for (pid_t pid; (pid = wait4(-1, &status, WNOHANG, &ru)) > 0;)
                for (int i = 0; i < njobs; i++)
                    if (jobs[i].pid == pid) {
                        struct result r = {-1, -1, jobs[i].timed_out, -1, -1, 0};
                        job_result(status, &ru, cgroup, &r);
                        send_result(jobs[i].answer, &r);
                        close(jobs[i].answer);
                        jobs[i] = jobs[--njobs];
                        idle_until = now_us() + (int64_t)s->idle_ms * 1000;
                        break;
                    }
        }
        if (!njobs && now_us() >= idle_until)
            break;
    }
    kill(-1, SIGKILL);
    return 0;
}

/* A run reads this init's command line (/proc/1/cmdline): it held the host's paths, the state dir and the run's
   cgroup, named with the holder's pid and the run's number among the holder's. The arguments are copied, and
   what the kernel shows of them blanked but for the program's name and the mode (for ps on the host). */
static char **own_arguments(int argc, char **argv) {
    static const char name[] = "image-builder-init";
    char **copy = calloc((size_t)argc + 1, sizeof *copy), *end = argv[argc - 1] + strlen(argv[argc - 1]);
    if (!copy)
        return NULL;
    for (int i = 0; i < argc; i++)
        if (!(copy[i] = strdup(argv[i])) || (i && argv[i] != argv[i - 1] + strlen(argv[i - 1]) + 1))
            return NULL; /* the kernel lays them out one after another: anything else is not an exec of ours */
    size_t shown = sizeof name + (argc > 1 ? strlen(copy[1]) + 1 : 0);
    if ((size_t)(end - argv[0]) + 1 < shown)
        return NULL;
    memset(argv[0], 0, (size_t)(end - argv[0]));
    memcpy(argv[0], name, sizeof name);
    if (argc > 1)
        memcpy(argv[0] + sizeof name, copy[1], strlen(copy[1]));
    return copy;
}

static int parse_spec(int argc, char **argv, struct spec *s) {
    if (argc < 12 || (argc - 12) % 3 ||
        (strcmp(argv[1], "session") && strcmp(argv[1], "joined") && strcmp(argv[1], "sandbox")))
        return -1;
    *s = (struct spec){.joined = !strcmp(argv[1], "joined"), .keep = !strcmp(argv[1], "sandbox"),
                       .base = argv[2], .lower = argv[3],
                       .userxattr = !strcmp(argv[4], "1"), .network = !strcmp(argv[5], "1"),
                       .scratch_mb = argv[6], .upper = argv[7], .cgroup = argv[8], .netns = atoi(argv[9]),
                       .console = argv[10], .idle_ms = atoi(argv[11]) * 1000,
                       .nbinds = (argc - 12) / 3, .binds = argv + 12};
    return 0;
}

/* N isolated network namespaces (lo up, the silent routes), each sent as a descriptor on fd 3
   (with one byte, "N": marshal's None), for the holder's pool: every run gets one of its own
   (what a run's sockets leave, TIME_WAIT and the counters of /proc/net, outlives its
   processes). Made here, a vfork'd exec, not in a fork of the Python holder, which copied
   the interpreter's page tables and took copy-on-write faults on both sides for each batch:
   4.35-4.62 ms of the machine's CPU a run of `true` (2 workers) that way, 3.98-4.38 now. */
static int make_netns(int n) {
    for (int i = 0; i < n; i++) {
        char byte = 'N', space[CMSG_SPACE(sizeof(int))] = {0};
        struct iovec iov = {&byte, 1};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space, .msg_controllen = sizeof space};
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        if (unshare(CLONE_NEWNET) || offline_network())
            return -1;
        int fd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return -1;
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
        int sent = sendmsg(CTL, &msg, MSG_NOSIGNAL);
        close(fd);
        if (sent != 1)
            return -1;
    }
    return 0;
}

/* pid 1 of a warm job's pid namespace (runtime/zygote.py): reaps what the job leaves to it, nothing else;
   the zygote forks the job's process into the namespace, waits for it and kills this init to end the
   rest. A Python fork as pid 1 cost every job a copy of the zygote's page tables, a few hundred
   copy-on-write faults and a teardown (281 faults of 1030 a job). It runs in the zygote's mount
   namespace, as the zygote's user: not dumpable (no process of the job may trace it or open its
   /proc files, its root among them) and without capabilities, before it says it is ready on fd 3. In a
   session of its own, made with the job: in the zygote's, /proc/1/autogroup (readable where a job mounts
   its own /proc: rootless) was a baseline older than the jobs before it (first_job says what it gave). */
static void on_child(int sig) { (void)sig; }

static int reap(void) {
    struct { uint32_t version; int pid; } head = {0x20080522, 0}; /* capset(2), _LINUX_CAPABILITY_VERSION_3 */
    struct { uint32_t effective, permitted, inheritable; } none[2] = {{0, 0, 0}, {0, 0, 0}};
    sigset_t chld, empty;
    sigemptyset(&chld);
    sigemptyset(&empty);
    sigaddset(&chld, SIGCHLD);
    if (setsid() < 0 || prctl(PR_SET_DUMPABLE, 0) || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
        syscall(SYS_capset, &head, none) || sigprocmask(SIG_BLOCK, &chld, NULL) ||
        signal(SIGCHLD, on_child) == SIG_ERR || write(CTL, "r", 1) != 1 || close(CTL))
        return 1;
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        sigsuspend(&empty);
    }
}

int main(int argc, char **argv) {
    struct spec s;
    /* Docker's umask (runc's default for a container's process), not the caller's: an HPC site's 077 made a
       run's root directory 0700 (closed to a sandbox's other users) and gave test suites other file modes
       than the reference harnesses' containers. Before anything is made: the root's directories too. */
    umask(RUN_UMASK);
    if (argc == 2 && !strcmp(argv[1], "reap"))
        return reap();
    if (argc == 3 && !strcmp(argv[1], "netns")) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        return make_netns(atoi(argv[2])) ? 1 : 0;
    }
    if (!(argv = own_arguments(argc, argv)) || parse_spec(argc, argv, &s)) {
        fprintf(stderr, "usage: image-builder-init session|joined|sandbox BASE LOWER USERXATTR NETWORK SCRATCH_MB UPPER "
                        "CGROUP NETNS_FD CONSOLE IDLE_SECONDS [SRC DEST RO]...\n(started by image_builder.runtime.holder)\n");
        return 2;
    }
    /* The control socket (3) and the network namespace (4) came without close-on-exec; the
       command must get neither (with 3 it could forge the answer, or take the next job). */
    if (syscall(SYS_close_range, CTL, ~0U, CLOSE_RANGE_CLOEXEC) && (fcntl(CTL, F_SETFD, FD_CLOEXEC) ||
                                                                   (s.netns >= 0 && fcntl(s.netns, F_SETFD, FD_CLOEXEC))))
        return 2;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    signal(SIGPIPE, SIG_IGN);
    /* Children are reaped as they end (run_job, through a signalfd): orphans of the command
       must not stay zombies, counted against its process limit. */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    signal(SIGCHLD, SIG_DFL);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    if ((children = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK)) < 0)
        return 2;
    int cgroup = -1, scratch[3] = {-1, -1, -1};
    int setup = enter_root(&s, &cgroup, scratch);
    if (setup) {
        char why[sizeof error - 40]; /* room for the prefix */
        snprintf(why, sizeof why, "%.*s", (int)sizeof why - 1, error);
        snprintf(error, sizeof error, "cannot build the instance's root: %s", why);
    }
    if (s.keep)
        return serve_sandbox(&s, setup, cgroup, scratch);
    /* One job, then this init ends with its root: the next run gets a fresh one. A root
       that served a next run when the last left it untouched (as inits once did) let
       a run see its predecessors: the pid namespace's counter moves with every fork (the
       next run read a count of them in its own pid), and whether a root is new shows in
       the times of what was made with it (a bit a run chose by leaving a trace or not),
       enough to alternate answers across a task's cases. A fresh root costs about 2 ms
       more of the machine's CPU a run here (2 workers, `true`: 2.2 ms reused, 4.0-4.4 ms
       fresh), most of it prepared ahead, while the session is busy elsewhere. */
    char *data = NULL;
    size_t len = 0;
    int stdio[3] = {-1, -1, -1}, owned = 0, ran = -1;
    struct job j = {0};
    struct result r;
    int got = receive(&s, &data, &len, &owned, stdio);
    if (got > 0)
        return 0; /* EOF: the init was not needed, or the session is done with it */
    if (!got && !setup && !decode_job(data, len, &j) && !first_job(&s, &j, scratch))
        ran = run_job(&s, &j, stdio, cgroup, &r);
    if (s.joined) {
        if (ran < 0) {
            fprintf(stderr, "image-builder: %s\n", error);
            return 125;
        }
        return r.exit_code >= 0 ? r.exit_code : 128 + r.sig;
    }
    if (ran < 0) /* a setup error is answered to the job */
        send_error(CTL);
    else if (!ran)
        send_result(CTL, &r);
    return 0;
}

