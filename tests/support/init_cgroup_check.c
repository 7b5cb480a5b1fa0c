/* The cgroup side of image_builder/runtime/native/init.c, run on a directory the test fills like
   a cgroup v2 (or v1 pids) directory: this host's memory controller is on cgroup v1, so
   the v2 limits and verdict cannot be met for real here. Prints "MEMORY_IN_CGROUP OOM
   PEAK_KB" after setting the limits of a job (MEMORY_MB, 77 processes). */
#define main init_main
#include "../../image_builder/runtime/native/init.c"
#undef main

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    int cg = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC), in_cgroup = -1;
    struct job j = {.memory_mb = atoll(argv[2]), .max_processes = 77};
    struct result r = {-1, -1, 0, -1, -1};
    if (cg < 0 || cgroup_limits(cg, &j, &in_cgroup)) {
        fprintf(stderr, "%s\n", error);
        return 1;
    }
    cgroup_verdict(cg, &r);
    printf("%d %d %lld\n", in_cgroup, r.oom, r.peak_kb);
    return 0;
}
