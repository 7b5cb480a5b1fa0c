"""Scale-out on Slurm: a sharded job array between jobs chained with afterok.

A run is a directory on the shared filesystem, STORE/slurm/<kind>-<time>/,
that a cluster admin can read and submit again by hand:

    job.sh         the batch script: `job.sh STAGE` runs that stage's image-builder
                   commands, then writes their exit status to status/STAGE.JOBID.rc
    submit.sh      submits every stage, each after the previous one succeeded, and
                   appends the job ids to `submissions`; `submit.sh 1,5` reruns only
                   shards 1 and 5 (with the stages around them)
    submissions    one line per submission: shards=0-3 shard=13 merge=14
    logs/STAGE.JOBID.log

A run's state comes from squeue (which keeps finished jobs for MinJobAge), else
sacct (only with slurmdbd), else the status files the jobs wrote; a job that
Slurm no longer knows and that left no status was killed (time limit, node
failure). Each stage and each shard takes the state of its latest submission,
so resubmitting the failed shards completes a run: the build resumes from its
per-item records; a grading shard resumes from its results file.

Two plans use this: a build (shards, then merge + verify) and a grading run
(prediction shards, then merge of the results).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from image_builder.errors import ImageBuilderError

RUN_FILE = "run.json"
SUBMISSIONS = "submissions"
# Slurm job states: not started yet, and ended for good; any other is under way.
WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD"}
ENDED = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


class SlurmError(ImageBuilderError):
    pass


class SqueueFailed(SlurmError):
    """The controller did not answer: the jobs go on, so a watcher tries again."""


class Raw(str):
    """A word of the job script left to the shell (a variable it expands), not quoted."""


@dataclass(frozen=True)
class Stage:
    name: str  # a shell identifier: submit.sh keeps the stage's job id in a variable of that name
    commands: tuple[tuple[str, ...], ...]  # image-builder arguments; each runs if the previous succeeded
    array: bool = False  # one task per shard, $SHARD being its number


@dataclass(frozen=True)
class Plan:
    kind: str  # build | import | grade
    home: Path  # runs go to home/slurm/: the store for a build; beside the results for grading (graders
    # may not own the store)
    shards: int
    stages: tuple[Stage, ...]  # in order, each after the previous succeeded; exactly one is the array
    product: Path  # what the last stage makes: the store's index.json, the merged results


@dataclass(frozen=True)
class SbatchOptions:
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    extra: tuple[str, ...] = ()  # more sbatch options, e.g. --account=proj

    def directives(self) -> list[str]:
        named = [("partition", self.partition), ("time", self.time), ("cpus-per-task", self.cpus_per_task)]
        options = [f"--{k}={v}" for k, v in named if v is not None] + list(self.extra)
        for opt in options:
            if not opt.startswith("-") or "\n" in opt:
                raise SlurmError(f"--sbatch-arg {opt!r}: expected one sbatch option, e.g. --account=proj")
        return [f"#SBATCH {opt}" for opt in options]


@dataclass(frozen=True)
class Submission:
    shards: tuple[int, ...]
    jobs: dict[str, str]  # stage name -> Slurm job id, for the stages submitted


@dataclass(frozen=True)
class Task:
    """One job of a run as last submitted: a stage, or one shard of the array."""
    stage: str
    job: str  # Slurm's id: 12, or 13_2 for shard 2 of array job 13
    shard: int | None
    state: str  # pending | running | done | failed
    detail: str  # Slurm's state and why, e.g. "TIMEOUT" or "FAILED, exit 1"
    log: Path


@dataclass(frozen=True)
class Snapshot:
    tasks: tuple[Task, ...]

    @property
    def finished(self) -> bool:
        return all(t.state in ("done", "failed") for t in self.tasks)

    @property
    def failed(self) -> list[Task]:
        return [t for t in self.tasks if t.state == "failed"]

    def summary(self) -> str:
        parts = []
        for stage in dict.fromkeys(t.stage for t in self.tasks):
            tasks = [t for t in self.tasks if t.stage == stage]
            if tasks[0].shard is None:
                parts.append(f"{stage} {tasks[0].state}")
                continue
            counts = {s: sum(t.state == s for t in tasks) for s in ("running", "pending", "failed")}
            done = sum(t.state == "done" for t in tasks)
            parts.append(f"{stage}s {done}/{len(tasks)} done" + "".join(f", {n} {s}" for s, n in counts.items() if n))
        return "; ".join(parts)


@dataclass(frozen=True)
class Run:
    directory: Path
    kind: str
    shards: int
    stages: tuple[str, ...]
    array: str  # the stage that is the job array
    product: Path

    @classmethod
    def open(cls, directory: Path) -> Run:
        directory = Path(directory).resolve()
        try:
            doc = json.loads((directory / RUN_FILE).read_text())
            # Runs written before grading had a plan name no kind or product: builds of their store.
            return cls(directory, doc.get("kind", "build"), doc["shards"], tuple(doc["stages"]), doc["array"],
                       Path(doc.get("product") or Path(doc.get("store", directory.parents[1])) / "index.json"))
        except (OSError, ValueError, KeyError, TypeError):
            raise SlurmError(f"{directory}: not a Slurm run of image-builder (no readable {RUN_FILE})") from None

    def log(self, stage: str, job: str) -> Path:
        return self.directory / "logs" / f"{stage}.{job}.log"

    def exit_status(self, stage: str, job: str) -> int | None:
        try:
            return int((self.directory / "status" / f"{stage}.{job}.rc").read_text())
        except (OSError, ValueError):
            return None

    def submissions(self) -> list[Submission]:
        path = self.directory / SUBMISSIONS
        lines = path.read_text().splitlines() if path.exists() else []
        subs = []
        for line in filter(None, lines):
            fields = dict(word.partition("=")[::2] for word in line.split())
            jobs = {s: fields[s] for s in self.stages if fields.get(s)}
            subs.append(Submission(parse_indices(fields.get("shards", "")), jobs))
        return subs


def parse_indices(spec: str) -> tuple[int, ...]:
    """Slurm's --array list ("0-3", "1,5", "0-9%2") as the indices it names."""
    found: list[int] = []
    for part in filter(None, spec.partition("%")[0].split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise SlurmError(f"{spec!r}: not a job array index list like 0-3 or 1,5")
        found += range(int(first), int(last or first) + 1)
    return tuple(sorted(set(found)))


def format_indices(indices: Iterable[int]) -> str:
    """The shortest --array list: [0, 1, 2, 5] -> 0-2,5."""
    ranges: list[list[int]] = []
    for i in sorted(set(indices)):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _render(argv: tuple[str, ...]) -> str:
    return " ".join(a if isinstance(a, Raw) else shlex.quote(a) for a in argv)


def _job_script(plan: Plan, run_dir: Path, directives: list[str], environ: dict[str, str]) -> str:
    stages = "|".join(s.name for s in plan.stages)
    lines = ["#!/bin/bash",
             f"# image-builder slurm {plan.kind} making {plan.product} in {plan.shards} shards, written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}.",
             f"# One job per stage ({stages}), the shards as an array; submit.sh beside this file chains them.",
             *directives,
             "set -uo pipefail",
             f"DIR={shlex.quote(str(run_dir))}"]
    if environ.get("SOURCE_DATE_EPOCH"):  # resubmissions, from any shell, make the same bytes
        lines.append(f"export SOURCE_DATE_EPOCH={shlex.quote(environ['SOURCE_DATE_EPOCH'])}")
    lines += ["CPUS=${SLURM_CPUS_PER_TASK:-1}  # what Slurm gave the job: builds and mksquashfs use no more",
              "SHARD=${SLURM_ARRAY_TASK_ID:-}",
              # The interpreter of the installation that wrote this: on the shared filesystem, the nodes have it.
              f"ib() {{ {shlex.quote(sys.executable)} -m image_builder.cli \"$@\"; }}",
              'case "${1:-}" in']
    for stage in plan.stages:
        lines.append(f"  {stage.name}) " + " && ".join(f"ib {_render(c)}" for c in stage.commands) + " ;;")
    lines += [f'  *) echo "usage: sbatch job.sh {stages}" >&2; exit 2 ;;',
              "esac",
              "rc=$?",
              "job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID}",
              'status="$DIR/status/$1.${job:-$SLURM_JOB_ID}.rc"',
              'echo "$rc" > "$status.tmp.$$" && mv "$status.tmp.$$" "$status"',
              'exit "$rc"']
    return "\n".join(lines) + "\n"


def _submit_script(plan: Plan, run_dir: Path) -> str:
    names = [s.name for s in plan.stages]
    lines = ["#!/bin/bash",
             f"# Submits the {plan.kind} run in this directory: {', then '.join(names)}, each after the previous "
             "succeeded.",
             f"# `submit.sh 1,5` reruns only shards 1 and 5; `submit.sh ''` only the stages after the "
             f"{next(s.name for s in plan.stages if s.array)}s.",
             "set -euo pipefail",
             f"DIR={shlex.quote(str(run_dir))}",
             f"SHARDS=${{1-0-{plan.shards - 1}}}",
             " ".join(f"{n}=''" for n in names) + " after='' submitted=''",
             # A chain broken halfway would leave jobs waiting for ones that never come.
             "trap '[ -z \"$submitted\" ] || scancel $submitted' ERR"]
    array_at = next(i for i, s in enumerate(plan.stages) if s.array)
    lines.append('if [ -n "$SHARDS" ]; then')
    for i, stage in enumerate(plan.stages):
        out = f"$DIR/logs/{stage.name}." + ("%A_%a.log" if stage.array else "%j.log")
        cmd = (f"sbatch --parsable --job-name=ib-{plan.kind}-{stage.name} "
               "${after:+--dependency=afterok:$after --kill-on-invalid-dep=yes} "
               + ('--array="$SHARDS" ' if stage.array else "") + f'--output="{out}" "$DIR/job.sh" {stage.name}')
        indent = "  " if i <= array_at else ""
        lines += [f"{indent}{stage.name}=$({cmd})",
                  # --parsable prints "id" or "id;cluster"
                  f'{indent}{stage.name}=${{{stage.name}%%;*}} after=${stage.name} submitted="$submitted '
                  f'${stage.name}"']
        if i == array_at:
            lines.append("fi")
    lines.append(f'echo "shards=$SHARDS {" ".join(f"{n}=${n}" for n in names)}" | tee -a "$DIR/{SUBMISSIONS}"')
    return "\n".join(lines) + "\n"


def write_run(plan: Plan, sbatch: SbatchOptions, environ: dict[str, str]) -> Run:
    """The run's directory under STORE/slurm/, with its scripts; nothing is submitted yet."""
    arrays = [s for s in plan.stages if s.array]
    if len(arrays) != 1:
        raise SlurmError(f"a {plan.kind} plan needs exactly one array stage, not {len(arrays)}")
    directives = sbatch.directives()  # a bad option fails before anything is written
    run_dir = _new_run_dir(plan.home / "slurm", plan.kind, ("logs", "status"))
    for name, text in (("job.sh", _job_script(plan, run_dir, directives, environ)),
                       ("submit.sh", _submit_script(plan, run_dir))):
        (run_dir / name).write_text(text)
        (run_dir / name).chmod(0o755)
    (run_dir / RUN_FILE).write_text(json.dumps({
        "kind": plan.kind, "shards": plan.shards, "stages": [s.name for s in plan.stages], "array": arrays[0].name,
        "product": str(plan.product)}, indent=2) + "\n")
    return Run.open(run_dir)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found: run this on a Slurm login node (Debian package slurm-client)")
    return path


def submit(run: Run, shards: Iterable[int] | None = None) -> Submission:
    """Submit the run's stages through submit.sh: all shards, or only these (none: only the later stages)."""
    _tool("sbatch")
    spec = f"0-{run.shards - 1}" if shards is None else format_indices(shards)
    r = subprocess.run(["bash", str(run.directory / "submit.sh"), spec], capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise SlurmError(f"submitting {run.directory / 'submit.sh'} failed: {why}")
    return run.submissions()[-1]


def _squeue(jobs: set[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} of the jobs and array tasks the controller still knows."""
    r = subprocess.run([_tool("squeue"), "-h", "--states=all", "--array", "-o", "%i|%T|%r", "-j", ",".join(jobs)],
                       capture_output=True, text=True)
    if r.returncode and "Invalid job id" in r.stderr:  # none of them is known any more
        return {}
    if r.returncode:
        raise SqueueFailed(f"squeue failed: {(r.stderr.strip().splitlines() or ['no message'])[-1]}")
    return {job: (state, reason) for job, state, reason in (line.split("|", 2) for line in r.stdout.splitlines())}


def _sacct(jobs: set[str]) -> dict[str, tuple[str, str]]:
    """The same from the accounting database, for jobs squeue forgot; nothing where there is no slurmdbd."""
    if not jobs or shutil.which("sacct") is None:
        return {}
    r = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j", ",".join(jobs)],
                       capture_output=True, text=True)
    found = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else ():
        job, state, code = (line.split("|") + ["", ""])[:3]
        found[job] = (state.split()[0] if state else "UNKNOWN", f"exit {code.split(':')[0]}" if code else "")
    return found


def _task(run: Run, stage: str, job: str, shard: int | None, known: dict[str, tuple[str, str]]) -> Task:
    rc = run.exit_status(stage, job)
    log = run.log(stage, job)
    if job not in known:
        if rc is None:  # killed hard, or Slurm forgot it before it could say
            return Task(stage, job, shard, "failed", "ended without an exit status (killed?)", log)
        return Task(stage, job, shard, "done" if rc == 0 else "failed", f"exit {rc}", log)
    state, reason = known[job]
    if state == "COMPLETED":
        return Task(stage, job, shard, "done", state, log)
    if state in ENDED:
        if reason == "DependencyNeverSatisfied":  # cancelled by --kill-on-invalid-dep
            why = "not run: a job it depends on failed"
        elif rc is not None:
            why = f"exit {rc}"
        else:
            why = "" if reason in ("None", "NonZeroExitCode") else reason
        return Task(stage, job, shard, "failed", f"{state}, {why}" if why else state, log)
    return Task(stage, job, shard, "pending" if state in WAITING else "running",
                f"{state} ({reason})" if reason not in ("None", "") else state, log)


def snapshot(run: Run) -> Snapshot:
    """Each stage and shard as its latest submission left it."""
    latest: dict[tuple[str, int | None], str] = {}
    for sub in run.submissions():
        for stage, job in sub.jobs.items():
            for shard in sub.shards if stage == run.array else (None,):
                latest[(stage, shard)] = job if shard is None else f"{job}_{shard}"
    if not latest:
        raise SlurmError(f"{run.directory}: nothing submitted yet; run submit.sh there")
    known = _squeue({job.partition("_")[0] for job in latest.values()})
    known |= _sacct({job for job in latest.values() if job not in known})
    order = {name: i for i, name in enumerate(run.stages)}
    keys = sorted(latest, key=lambda k: (order[k[0]], -1 if k[1] is None else k[1]))
    return Snapshot(tuple(_task(run, stage, latest[(stage, shard)], shard, known) for stage, shard in keys))


def follow(run: Run, report: Callable[[Snapshot], None], poll: float = 5.0, patience: float = 300.0) -> Snapshot:
    """Poll until every job of the run has ended, reporting each change; squeue may fail for `patience` seconds."""
    _tool("squeue")
    last, failing_since = None, None
    while True:
        try:
            snap = snapshot(run)
            failing_since = None
        except SqueueFailed:
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > patience:
                raise
            time.sleep(poll)
            continue
        if snap.summary() != last:
            report(snap)
            last = snap.summary()
        if snap.finished:
            return snap
        time.sleep(poll)


def resubmit(run: Run) -> Submission:
    """Submit again what failed: the failed shards with the stages around them, or only the later stages."""
    snap = snapshot(run)
    if not snap.finished:
        raise SlurmError(f"{run.directory}: jobs still pending or running ({snap.summary()}); "
                         "wait for them (image-builder slurm status --wait) or scancel them")
    if not snap.failed:
        raise SlurmError(f"{run.directory}: nothing to resubmit, every job succeeded")
    return submit(run, [t.shard for t in snap.failed if t.stage == run.array])


def log_excerpt(path: Path, lines: int = 5) -> list[str]:
    """What a failed job's log says went wrong: its `failed:` lines (image-builder's one-line errors), else its
    last lines (a job Slurm killed ends with slurmstepd's note)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in text if line.startswith("failed: ")][-lines:] or text[-lines:]


# The build: the shards (each environment built once, by the first shard needing it), then one index.

def _pull_args(cache_dir: Path | None, ca_cert: Path | None, plain_http: tuple[str, ...],
               insecure_tls: tuple[str, ...]) -> list[str]:
    """The blob cache and registry options of a build or import, for its array tasks."""
    args = []
    for flag, value in (("--cache-dir", cache_dir), ("--ca-cert", ca_cert)):
        if value is not None:
            args += [flag, str(Path(value).resolve())]
    for flag, hosts in (("--plain-http", plain_http), ("--insecure-tls", insecure_tls)):
        for host in hosts:
            args += [flag, host]
    return args


def _merge_index(store: Path) -> Stage:
    """The last stage of a sharded build or import: the shards' index fragments into index.json, checked."""
    return Stage("merge", (("index", "merge", "--store", str(store)), ("verify", "--store", str(store))))


def build_plan(catalog: Path, store: Path, shards: int, *, bases: dict[str, str], cache_dir: Path | None,
               ca_cert: Path | None, plain_http: tuple[str, ...], insecure_tls: tuple[str, ...],
               compression: str) -> Plan:
    """The stages of a sharded build: the shards (environments as needed, then instances), then merge and
    verify."""
    from image_builder.build.catalog import load
    cat = load(catalog, bases=bases)  # errors now, not in a job after a wait in the queue
    if shards > len(cat.instances):
        raise SlurmError(f"--shards {shards}: {catalog} has only {len(cat.instances)} instances")
    store = store.resolve()
    args = ["build", str(catalog.resolve()), "--store", str(store), "--compression", compression,
            "-j", Raw('"$CPUS"'), "--processors", Raw('"$CPUS"')]
    for alias, ref in bases.items():
        args += ["--base", f"{alias}={ref}"]
    args += _pull_args(cache_dir, ca_cert, plain_http, insecure_tls)
    # No job of its own for the environments (a scheduling hop, 2-3 s): each shard builds those its
    # instances need under per-item locks, so each is built once, by whichever shard comes first.
    return Plan("build", store, shards, (
        Stage("shard", ((*args, "--shard", Raw(f'"$SHARD/{shards}"'), "--attempt", Raw('"$SLURM_ARRAY_JOB_ID"')),),
              array=True),
        _merge_index(store),
    ), store / "index.json")


def import_plan(refs: tuple[str, ...], list_file: Path | None, store: Path, shards: int, *,
                env_layers: tuple[str, ...], id_from: str | None, cache_dir: Path | None, ca_cert: Path | None,
                plain_http: tuple[str, ...], insecure_tls: tuple[str, ...]) -> Plan:
    """The stages of a sharded import: the shards (every one reads all the manifests, so the split is
    one import's; each environment is packed once, by the first shard needing it), then merge and verify."""
    from image_builder.build.imports import read_list
    count = len(refs) + (len(read_list(list_file)) if list_file else 0)  # errors now, not after a queue wait
    if shards > count:
        raise SlurmError(f"--shards {shards}: only {count} images to import")
    store = store.resolve()
    args = ["import", *refs, "--store", str(store), "-j", Raw('"$CPUS"')]
    if list_file is not None:
        args += ["--from-file", str(list_file.resolve())]
    for rule in env_layers:
        args += ["--env-layers", rule]
    if id_from:
        args += ["--id-from", id_from]
    args += _pull_args(cache_dir, ca_cert, plain_http, insecure_tls)
    return Plan("import", store, shards, (
        Stage("shard", ((*args, "--shard", Raw(f'"$SHARD/{shards}"')),), array=True),
        _merge_index(store),
    ), store / "index.json")


def drop_other_fragments(store: Path, shards: int) -> list[Path]:
    """Index fragments of an earlier build in another number of shards: `index merge` would mix them in."""
    from image_builder.build.storebuild import FRAGMENTS_DIR
    stale = [p for p in (store / FRAGMENTS_DIR).glob("shard-*-of-*.json")
             if not re.fullmatch(rf"shard-\d+-of-{shards}\.json", p.name)]
    for p in stale:
        p.unlink()
    return stale


# Grading: the predictions in shards (whole instances each), then one results file and its summary.

def grade_plan(store: Path, tasks: Path, predictions: Path, output: Path, shards: int,
               grade_args: tuple[str, ...] = ()) -> Plan:
    """The stages of a sharded grading run; `grade_args` are more options of `grade` (--timeout ...)."""
    from image_builder.graders import load_predictions, load_tasks
    from image_builder.graders.grading import instance_of
    from image_builder.store.store import Store
    Store.open(store)  # errors now, not in a job after a wait in the queue
    by_id = {t.task_id: instance_of(t) for t in load_tasks(tasks)}
    instances = {by_id.get(p.task_id, p.task_id) for p in load_predictions(predictions)}
    if shards > len(instances):
        raise SlurmError(f"--shards {shards}: {predictions} has predictions for only {len(instances)} instances")
    store, tasks, predictions, output = (p.resolve() for p in (store, tasks, predictions, output))
    part = f'"$DIR/results/shard-$SHARD-of-{shards}.jsonl"'
    grade = ("grade", "--store", str(store), "--tasks", str(tasks), "--predictions", str(predictions),
             "-o", Raw(part), "--shard", Raw(f'"$SHARD/{shards}"'), "-j", Raw('"$CPUS"'), *grade_args)
    merge = ("results", "merge", "--predictions", str(predictions), "-o", str(output),
             Raw(f'"$DIR"/results/shard-*-of-{shards}.jsonl'))
    return Plan("grade", output.parent, shards, (Stage("shard", (grade,), array=True), Stage("merge", (merge,))),
                output)


# --- serving: one `image-builder serve` per node of an allocation --------------------------------------------

@dataclass(frozen=True)
class ServeJob:
    """A job running a server on each of its nodes; each writes its URL to urls/<node> once it listens and
    removes it when it stops, and urls.txt lists them all once every node's server is up."""
    directory: Path
    job: str
    nodes: int

    @property
    def log(self) -> Path:
        return self.directory / "logs" / f"serve.{self.job}.log"

    def urls(self) -> list[str]:
        found = [p.read_text().strip() for p in sorted((self.directory / "urls").glob("*"))
                 if not p.name.startswith(".")]
        return [u for u in found if u]


def _serve_script(run_dir: Path, store: Path, nodes: int, serve_args: tuple[str, ...], directives: list[str]) -> str:
    serve = _render((sys.executable, "-m", "image_builder.cli", "serve", "--store", str(store), "--host", "0.0.0.0",
                     *serve_args))
    return "\n".join([
        "#!/bin/bash",
        f"# image-builder slurm serve: SandboxFusion's API over {store}, one server per node of {nodes}, written "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}.",
        "# Each writes its URL to urls/<node> when it listens (removed when it stops); stop them with scancel.",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *directives,
        "set -uo pipefail",
        f"export DIR={shlex.quote(str(run_dir))}",
        # One task per node, each naming its own URL file ($SLURMD_NODENAME is the task's node).
        f"srun --kill-on-bad-exit=0 bash -c 'exec \"$@\" --url-file \"$DIR/urls/$SLURMD_NODENAME\"' serve {serve}",
    ]) + "\n"


def _new_run_dir(parent: Path, kind: str, subdirs: tuple[str, ...]) -> Path:
    """PARENT/KIND-<time>[-N], made new (never an earlier run's), with its SUBDIRS."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        run_dir = (parent / f"{kind}-{stamp}{f'-{attempt}' if attempt else ''}").resolve()
        try:
            run_dir.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    else:
        raise SlurmError(f"{parent}: cannot make a new run directory")
    for sub in subdirs:
        (run_dir / sub).mkdir()
    return run_dir


def start_servers(store: Path, nodes: int, serve_args: tuple[str, ...], sbatch: SbatchOptions) -> ServeJob:
    """Write STORE/slurm/serve-<time>/job.sh and submit it; nothing is waited for."""
    directives = sbatch.directives()
    run_dir = _new_run_dir(store / "slurm", "serve", ("logs", "urls"))
    script = run_dir / "job.sh"
    script.write_text(_serve_script(run_dir, store.resolve(), nodes, serve_args, directives))
    script.chmod(0o755)
    r = subprocess.run([_tool("sbatch"), "--parsable", "--job-name=ib-serve",
                        f"--output={run_dir}/logs/serve.%j.log", str(script)], capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise SlurmError(f"sbatch {script} failed: {why}")
    return ServeJob(run_dir, r.stdout.strip().split(";")[0], nodes)


def wait_for_servers(job: ServeJob, timeout: float, poll: float = 1.0) -> list[str]:
    """The servers' URLs once all are up, also written to urls.txt (one per line); SlurmError when the job
    ended first (with its log's last lines) or `timeout` passed (the job is left to run: scancel it)."""
    deadline = time.monotonic() + timeout
    while True:
        urls = job.urls()
        if len(urls) >= job.nodes:
            text = "".join(f"{u}\n" for u in urls)
            tmp = job.directory / ".urls.txt.tmp"
            tmp.write_text(text)
            tmp.replace(job.directory / "urls.txt")
            return urls
        state = _squeue({job.job}).get(job.job, ("ENDED", ""))[0]
        if state in ENDED or state == "ENDED":
            tail = " | ".join(log_excerpt(job.log, 3)) if job.log.exists() else "no log"
            raise SlurmError(f"job {job.job} ended ({state}) with {len(urls)} of {job.nodes} servers up: {tail}")
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job.job}: {len(urls)} of {job.nodes} servers up after {timeout:g} s ({state}); "
                             f"its log: {job.log}; scancel {job.job} to give up")
        time.sleep(poll)
