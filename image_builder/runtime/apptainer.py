"""The apptainer backend: each run is one `apptainer exec` of the instance's layers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .execution import Bind, RunRequest, RunResult
from .mounts import RUN_UMASK, RunnerError
from .session import Backend, Captured, InstanceLayers, Session, build_result, collect, stdin_fd


def apptainer_command(layers: InstanceLayers, request: RunRequest, *, binds: tuple[Bind, ...] = (),
                      files_dir: Path | None = None) -> list[str]:
    """`apptainer exec --containall --overlay inst.sqfs:ro env.sif CMD`, with the request's
    options mapped. `files_dir` holds request.files staged on the host at their paths
    inside (files_dir/testbed/case.py for /testbed/case.py), bound in: each file on its
    own, those under /tmp as one /tmp (--containall's is empty), so that a run can
    delete them. A variable whose value has a comma goes in as APPTAINERENV_NAME
    through `env`: --env splits on commas (apptainer/singularity#6088)."""
    workdir = request.workdir or layers.workdir
    prefix, cmd = [], ["apptainer", "exec", "--containall", "--writable-tmpfs", "--pwd", workdir]
    for overlay in layers.overlays:  # bottom to top: the last one given is the top layer
        cmd += ["--overlay", f"{overlay}:ro"]
    if not request.network:
        cmd += ["--net", "--network", "none"]
    if request.memory_mb:
        cmd += ["--memory", f"{request.memory_mb}M"]
    for b in binds:
        cmd += ["--bind", f"{b.src}:{b.dest}:{'ro' if b.readonly else 'rw'}"]
    if request.files and files_dir is None:
        raise RunnerError("request.files needs files_dir, a host directory holding them")
    inside = sorted(request.placed_files(layers.workdir))
    if any(path.startswith("/tmp/") for path in inside):
        cmd += ["--bind", f"{files_dir}/tmp:/tmp:rw"]
    for path in inside:
        if not path.startswith("/tmp/"):
            cmd += ["--bind", f"{files_dir}{path}:{path}:rw"]
    for key, value in {**layers.env, **request.env}.items():
        if "," in value:
            prefix.append(f"APPTAINERENV_{key}={value}")
        else:
            cmd += ["--env", f"{key}={value}"]
    return [*(["env", *prefix] if prefix else []), *cmd, str(layers.env_sif), *request.argv]


class ApptainerSession(Session):
    """Each run is one `apptainer exec`: Apptainer mounts per run (no warm mounts), and
    limits processes and memory only where it has cgroups."""

    backend = Backend.APPTAINER

    def __init__(self, layers: InstanceLayers, binds: tuple[Bind, ...], max_processes: int):
        super().__init__(layers, max_processes)
        self.binds = binds

    def run(self, request: RunRequest) -> RunResult:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ib-apptainer-") as staged:
            for path, data in request.placed_files(self.layers.workdir).items():
                host = Path(staged, path.lstrip("/"))
                host.parent.mkdir(parents=True, exist_ok=True)
                host.write_bytes(data)
            cmd = apptainer_command(self.layers, request, binds=self.binds, files_dir=Path(staged))
            return _run_process(cmd, request, dict(os.environ))

    def shell(self, argv: tuple[str, ...] = ("/bin/sh",), persist: Path | None = None, *,
              network: bool = False) -> int:
        import subprocess

        if persist is not None:
            raise RunnerError("the apptainer backend keeps no upper directory; drop persist")
        cmd = apptainer_command(self.layers, RunRequest(tuple(argv), network=network), binds=self.binds)
        return subprocess.call(cmd)


def _run_process(cmd: list[str], request: RunRequest, env: dict[str, str]) -> RunResult:
    """A host command (apptainer) with the request's stdin, output capture and timeout;
    the process group is killed at the timeout."""
    import signal
    import subprocess

    stdin = stdin_fd(request.stdin)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=out_w, stderr=err_w, env=env, start_new_session=True,
                                umask=RUN_UMASK)
    finally:
        for fd in (stdin, out_w, err_w):
            os.close(fd)
    timed_out = False
    try:
        deadline = None if request.timeout is None else t0 + request.timeout
        try:
            got = collect(out_r, err_r, request.max_output, deadline)
        except TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            got = Captured()
        status = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        os.close(out_r)
        os.close(err_r)
    sig = -status if status < 0 else None
    return build_result(got, request, time.monotonic() - t0, None if sig else status, sig, timed_out, None, None)

