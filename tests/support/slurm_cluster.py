"""A real one-node Slurm cluster for the tests and benchmarks: Debian's munged, slurmctld and slurmd.

Everything (munge key, slurm.conf, state, spool, logs, sockets) lives in one
directory and the daemons listen on free ports, so a system Slurm, if any, is
left alone; clients reach this one through $SLURM_CONF (`cluster.env`). The
daemons run as root in the foreground, as children of this process, and are
stopped by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.devtools.localregistry import free_port

# A binary of each Debian package, to tell whether the package is there.
PACKAGES = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client"}


def ensure_installed() -> None:
    """`make test` installs these (APT_TEST); a bare pytest run installs them too."""
    missing = [pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=True,
                       stdout=subprocess.DEVNULL, env=env)


@dataclass
class SlurmCluster:
    root: Path
    node: str
    cpus: int
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, check=check, env={**os.environ, **self.env})

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted((self.root / "log").glob("*")))

    def stop(self) -> None:
        """Cancel every job of this cluster, then stop the daemons, newest first."""
        if self.procs and self.procs[-1].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%A", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run("squeue", "-h", "-t", "R,CG", check=False).stdout:
                    time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()


def _config(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (2 << 20)  # half of it
    return f"""\
ClusterName=ibtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/run/munge.sock
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# Cancelled jobs get SIGKILL 5 s after SIGTERM (default 30).
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: Path, timeout: float = 60) -> SlurmCluster:
    """munged, slurmctld and slurmd in `root` (which must be world-searchable: munge checks the socket's
    directories); returns once the node is idle."""
    ensure_installed()
    cluster = SlurmCluster(root, socket.gethostname().split(".")[0], os.cpu_count() or 1)
    for sub, mode in (("key", 0o700), ("run", 0o755), ("state", 0o700), ("spool", 0o700), ("log", 0o755)):
        (root / sub).mkdir(mode=mode)
    key = root / "key" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    cluster.conf.write_text(_config(root, cluster.node, cluster.cpus, free_port(), free_port()))
    daemons = [
        ["munged", "--foreground", f"--key-file={key}", f"--socket={root}/run/munge.sock",
         f"--pid-file={root}/run/munged.pid", f"--seed-file={root}/key/munge.seed",
         f"--log-file={root}/log/munged.log"],
        ["slurmctld", "-D", "-f", str(cluster.conf)],
        ["slurmd", "-D", "-f", str(cluster.conf), "-N", cluster.node],
    ]
    try:
        for cmd in daemons:
            with open(root / "log" / f"{cmd[0]}.out", "wb") as out:
                cluster.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                      env={**os.environ, **cluster.env}))
            if cmd[0] == "munged":
                _until(lambda: (root / "run/munge.sock").exists(), timeout, "munged did not start", cluster)
        _until(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip() == "idle",
               timeout, "the node did not become idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _until(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what} ({', '.join(dead) + ' exited' if dead else 'timeout'}):\n{cluster.logs()}")
        time.sleep(0.2)
