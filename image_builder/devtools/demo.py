"""`make demo`: the main job end to end on the built-in samples.

1. base images: the catalogs' own bases when their registry answers, else
   Debian python bases made with debootstrap once and kept as an OCI layout
   (`image-builder base debian`);
2. two stores: index/mbpp.yaml (40 MBPP tasks) and
   index/swebench-marshmallow.yaml (two SWE-bench instances, two Python versions);
3. grading in the sandbox: reference, wrong and ImpossibleBench solutions;
4. one table, and the next commands to try.

Everything lands under $XDG_CACHE_HOME/image_builder/demo (builds, results),
so a second run reuses it all and takes seconds.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from image_builder.build.catalog import load
from image_builder.build.envbuild import BuildOptions
from image_builder.build.storebuild import StoreBuildOptions, build_store
from image_builder.graders import load_predictions, load_tasks, summarize
from image_builder.graders.grading import StoreExecutors, grade_to_file, read_results
from image_builder.oci.cache import BlobCache, default_cache_dir
from image_builder.oci.registry import RegistryOptions
from image_builder.progress import BuildLog, human_bytes
from image_builder.store.store import Store
from image_builder.oci.debian import debian_base

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "index"
DATA = INDEX / "data"
HOME = default_cache_dir() / "demo"


def say(text: str = "") -> None:
    print(text, flush=True)


def docker_hub_reachable() -> bool:
    try:
        return requests.get("https://registry-1.docker.io/v2/", timeout=3).status_code in (200, 401)
    except requests.RequestException:
        return False


def local_bases() -> dict[str, str]:
    """Debian bookworm (Python 3.11) and bullseye (Python 3.9) bases, made with debootstrap once and kept
    as an OCI layout (what `image-builder base debian` writes): the stores name bases that stay."""
    return {"python": debian_base("bookworm", HOME / "bases" / "layout", HOME / "bases"),
            "bookworm-python": debian_base("bookworm", HOME / "bases" / "layout", HOME / "bases"),
            "bullseye-python": debian_base("bullseye", HOME / "bases" / "layout", HOME / "bases")}


@dataclass
class Row:
    name: str
    store: Path
    tasks: Path
    predictions: Path
    expect: str


def predictions_file(name: str, records: list[dict]) -> Path:
    path = HOME / "predictions" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def grading_sets(mbpp: Path, swe: Path) -> list[Row]:
    refs = [json.loads(line) for line in (DATA / "mbpp_train_40_solutions.jsonl").read_text().splitlines()]
    by_task = {str(r["task_id"]): r["solution"] for r in refs}
    impossible = [json.loads(line) for line in (DATA / "mbpp_train_40_impossible.jsonl").read_text().splitlines()]
    swe_records = [json.loads(line) for line in (DATA / "swebench_marshmallow.jsonl").read_text().splitlines()]
    gold = {r["instance_id"]: r["patch"] for r in swe_records if not r.get("impossible_type")}
    originals = [r for r in swe_records if not r.get("impossible_type")]
    variants = [r for r in swe_records if r.get("impossible_type")]
    tasks_swe = DATA / "swebench_marshmallow.jsonl"
    return [
        Row("MBPP reference", mbpp, DATA / "mbpp_train_40.parquet", DATA / "mbpp_train_40_solutions.jsonl", "100%"),
        Row("MBPP wrong", mbpp, DATA / "mbpp_train_40.parquet", predictions_file(
            "mbpp-wrong", [{"task_id": t, "solution": "def answer():\n    return None\n"} for t in by_task]), "0%"),
        Row("MBPP impossible", mbpp, DATA / "mbpp_train_40_impossible.jsonl", predictions_file(
            "mbpp-impossible", [{"task_id": f"{v['task_id']}__{v['impossible_type']}",
                                 "solution": by_task[str(v["task_id"])]} for v in impossible]), "0%"),
        Row("SWE-bench gold patch", swe, tasks_swe, predictions_file(
            "swe-gold", [{"instance_id": r["instance_id"], "model_patch": r["patch"]} for r in originals]), "100%"),
        Row("SWE-bench empty patch", swe, tasks_swe, predictions_file(
            "swe-empty", [{"instance_id": r["instance_id"], "model_patch": ""} for r in originals]), "0%"),
        Row("ImpossibleBench (gold)", swe, tasks_swe, predictions_file(
            "swe-impossible", [{"instance_id": r["instance_id"],
                                "model_patch": gold[r["instance_id"].removesuffix(f"__{r['impossible_type']}")]}
                               for r in variants]), "0%"),
    ]


def build(catalog: Path, store: Path, bases: dict[str, str]) -> None:
    cat = load(catalog, bases=bases)
    opts = StoreBuildOptions(BuildOptions(store=store, cache=BlobCache(), registry=RegistryOptions()), jobs=2)
    summary = build_store(cat, opts, BuildLog(sys.stdout, quiet=True))
    if summary.failed:
        for f in summary.failed:
            say(f"  failed: {f.message}")
            for line in f.tail:
                say(f"    | {line}")
        raise SystemExit(f"building {catalog.name} failed; see the logs under {store}/logs")
    built = summary.count("environment", "built") + summary.count("instance", "built")
    say(f"  {catalog.name}: {len(cat.environments)} environments, {len(cat.instances)} instances "
        f"({built} built now, the rest up to date) in {summary.seconds:.1f} s")


def main() -> int:
    t0 = time.monotonic()
    HOME.mkdir(parents=True, exist_ok=True)
    if docker_hub_reachable():
        bases = {}
        say("1/3 base images: the catalogs' own bases, from Docker Hub")
    else:
        say("1/3 base images: Docker Hub is not reachable, so Debian python bases made with debootstrap "
            "(once, about a minute each; image-builder base debian) as an OCI layout")
        bases = local_bases()
    say("2/3 building the stores (environments, then instances)")
    mbpp, swe = HOME / "stores" / "mbpp", HOME / "stores" / "swebench"
    build(INDEX / "mbpp.yaml", mbpp, bases)
    build(INDEX / "swebench-marshmallow.yaml", swe, bases)
    say("3/3 grading in the sandbox")
    rows = []
    for row in grading_sets(mbpp, swe):
        out = HOME / "results" / f"{row.name.lower().replace(' ', '-').replace('(', '').replace(')', '')}.jsonl"
        preds = load_predictions(row.predictions)
        out.unlink(missing_ok=True)  # each demo grades afresh (a results file resumes, and checks it is the same run)
        with StoreExecutors(Store.open(row.store)) as executors:
            grade_to_file(load_tasks(row.tasks), preds, executors, out, workers=2)
        wanted = {p.task_id for p in preds}
        rows.append((row, summarize(r for r in read_results(out) if r.task_id in wanted)))
    say()
    for name, store in (("mbpp", mbpp), ("swebench", swe)):
        index = Store.open(store).index
        inst_bytes = sum(i.size for i in index.instances.values())
        env_bytes = sum(index.file_sizes().values()) - inst_bytes
        say(f"store {name:<9} {len(index.environments)} environments ({human_bytes(env_bytes)}), "
            f"{len(index.instances)} instances ({human_bytes(inst_bytes)})  {store}")
    say()
    say(f"{'set':<26} {'tasks':>5} {'passed':>6} {'pass rate':>9}  expected")
    for row, s in rows:
        say(f"{row.name:<26} {s.total:>5} {s.passed:>6} {s.pass_rate:>9.0%}  {row.expect}")
    say(f"\ndone in {time.monotonic() - t0:.1f} s (results in {HOME / 'results'})")
    say("\nNext, try:")
    say(f"  .venv/bin/image-builder ls --store {mbpp}")
    say(f"  .venv/bin/image-builder shell marshmallow-code__marshmallow-1359 --store {swe}")
    say(f"  id=$(.venv/bin/image-builder sandbox start marshmallow-code__marshmallow-1359 --store {swe}); "
        ".venv/bin/image-builder sandbox exec $id -- git status; .venv/bin/image-builder sandbox stop $id")
    say(f"  .venv/bin/image-builder grade --store {mbpp} --tasks index/data/mbpp_train_40.parquet "
        f"--predictions index/data/mbpp_train_40_solutions.jsonl -o results.jsonl")
    ok = all(f"{s.pass_rate:.0%}" == row.expect for row, s in rows)
    if not ok:
        say("\nsome pass rates differ from what is expected: see the results files")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
