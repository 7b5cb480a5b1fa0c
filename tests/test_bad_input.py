"""Hostile input through the real CLI: every case ends with exit status 1 or 2 and one line on stderr, no
traceback, and leaves every file as it was (a store already built, files outside it, no new files)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from image_builder.store.index import EnvRecord, Index, InstanceRecord, write_index
from tests.conftest import run_cli

BASE = "127.0.0.1:9/none:1"  # parses as a reference; no case gets as far as pulling it
DIGEST = "sha256:" + "0" * 64
GOOD_TASK = json.dumps({"task_id": "t1", "assert_case": ["assert 1"]}) + "\n"
GOOD_PREDICTION = json.dumps({"task_id": "t1", "solution": "x = 1"}) + "\n"


def catalog(environments=None, instances=(), instance_sets=(), **top) -> str:
    doc = {"scripts_dir": "scripts",
           "environments": [{"name": "e1", "base": BASE, "scripts": ["env.sh"]}] if environments is None
           else environments, **top}
    if instances:
        doc["instances"] = list(instances)
    if instance_sets:
        doc["instance_sets"] = list(instance_sets)
    return yaml.safe_dump(doc, sort_keys=False)


def inst(iid, **kw) -> dict:
    return {"id": iid, "environment": "e1", **kw}


def dataset_catalog(name: str = "data.jsonl") -> str:
    return catalog(instance_sets=[{"from": name, "environment": "e1"}])


def rows(*ids) -> str:
    return "".join(json.dumps({"task_id": i, "assert_case": ["assert 1"]}) + "\n" for i in ids)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hand_store(root: Path) -> dict:
    """A small valid store written by hand (no build): one environment, one instance; returns its index doc."""
    (root / "envs").mkdir(parents=True)
    (root / "instances").mkdir()
    (root / "envs/e1.sif").write_bytes(b"sif bytes")
    (root / "instances/i1.sqfs").write_bytes(b"sqfs bytes")
    env = EnvRecord("e1", "envs/e1.sif", sha(b"sif bytes"), 9, BASE, DIGEST, DIGEST, 0, {"A": "1"})
    instance = InstanceRecord("i1", "e1", "instances/i1.sqfs", sha(b"sqfs bytes"), 10, DIGEST)
    write_index(root, Index({"e1": env}, {"i1": instance}))
    return json.loads((root / "index.json").read_text())


def index_with(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite the hand-made store's index.json through `change` (which edits the doc, or returns bytes)."""
    def apply(tmp: Path) -> None:
        doc = json.loads((tmp / "store/index.json").read_text())
        out = change(doc)
        data = out if isinstance(out, bytes) else json.dumps(doc).encode()
        (tmp / "store/index.json").write_bytes(data)
    return apply


def env_field(key, value):
    return index_with(lambda d: d["environments"]["e1"].__setitem__(key, value))


def inst_field(key, value):
    return index_with(lambda d: d["instances"]["i1"].__setitem__(key, value))


@dataclass
class Case:
    name: str
    args: list[str]  # "{tmp}" stands for the case's directory
    files: dict[str, str | bytes] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None  # after the store is made
    fails_before: bool = True  # whether the code before this test got it wrong (traceback, 0, or many lines)


CHECK = ["check", "{tmp}/catalog.yaml"]
BUILD = ["build", "{tmp}/catalog.yaml", "--store", "{tmp}/store"]
GRADE = ["grade", "--store", "{tmp}/store", "--tasks", "{tmp}/tasks.jsonl", "--predictions", "{tmp}/preds.jsonl",
         "-o", "{tmp}/results.jsonl"]
STORE = ["--store", "{tmp}/store"]
DEEP = "[" * 100_000 + "]" * 100_000
# Nine levels of ten aliases each: 10**9 strings once expanded, a few hundred bytes as YAML.
LAUGHS = "grader:\n    l0: &l0 [lol]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10))

CASES = [
    # --- catalogs -----------------------------------------------------------------------------------------
    Case("catalog binary", CHECK, {"catalog.yaml": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\xfd"}),
    Case("catalog latin-1", BUILD, {"catalog.yaml": "environments: []  # caf\xe9\n".encode("latin-1")}),
    Case("catalog NUL byte", CHECK, {"catalog.yaml": b"environments:\x00 []\n"}),
    Case("catalog bad YAML", CHECK, {"catalog.yaml": "environments: [\n  - {name: a\n"}, fails_before=False),
    Case("catalog nested 100000 deep", CHECK, {"catalog.yaml": "environments: " + DEEP}),
    Case("catalog a list", CHECK, {"catalog.yaml": "- 1\n- 2\n"}, fails_before=False),
    Case("catalog bases a list", CHECK, {"catalog.yaml": catalog(bases=[1, 2])}),
    Case("catalog base alias to a number", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": "py", "scripts": ["env.sh"]}], bases={"py": 5})}),
    Case("catalog instances a number", CHECK, {"catalog.yaml": catalog(instances=None) + "instances: 5\n"}),
    Case("catalog instance_sets a number", CHECK, {"catalog.yaml": catalog() + "instance_sets: 5\n"}),
    Case("catalog scripts_dir a number", CHECK, {"catalog.yaml": catalog().replace("scripts_dir: scripts",
                                                                                   "scripts_dir: 5")}),
    Case("catalog timeout nan", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": BASE, "scripts": ["env.sh"], "timeout": float("nan")}])}),
    Case("catalog env value a list", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": BASE, "scripts": ["env.sh"], "env": {"A": [1]}}])},
         fails_before=False),
    Case("catalog env value with NUL", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": BASE, "scripts": ["env.sh"], "env": {"A": "a\0b"}}])}),
    Case("catalog script name with NUL", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": BASE, "scripts": ["env\0.sh"]}])}, fails_before=False),
    Case("catalog context with NUL", CHECK,
         {"catalog.yaml": catalog([{"name": "e1", "base": BASE, "scripts": ["env.sh"], "context": "a\0b"}])}),
    Case("environment name ../x", BUILD,
         {"catalog.yaml": catalog([{"name": "../x", "base": BASE, "scripts": ["env.sh"]}])}, fails_before=False),
    Case("environment name with NUL", CHECK,
         {"catalog.yaml": catalog([{"name": "e\0", "base": BASE, "scripts": ["env.sh"]}])}, fails_before=False),
    Case("instance id ../../x", BUILD, {"catalog.yaml": catalog(instances=[inst("../../x")])}, fails_before=False),
    Case("instance id a/..", CHECK, {"catalog.yaml": catalog(instances=[inst("a/..")])}, fails_before=False),
    Case("instance id /abs", CHECK, {"catalog.yaml": catalog(instances=[inst("/abs")])}, fails_before=False),
    Case("instance id with NUL", CHECK, {"catalog.yaml": catalog(instances=[inst("a\0b")])}, fails_before=False),
    Case("instance id empty", CHECK, {"catalog.yaml": catalog(instances=[inst("")])}, fails_before=False),
    Case("instance id overlong", CHECK, {"catalog.yaml": catalog(instances=[inst("x" * 300)])},
         fails_before=False),
    Case("instance id a number", CHECK, {"catalog.yaml": catalog(instances=[inst(7)])}, fails_before=False),
    Case("instance file to ../../../", CHECK,  # the sandbox's staging would write it on the host
         {"catalog.yaml": catalog(instances=[inst("i1", files={"../../../../tmp/ib-pwned": "f.txt"})]),
          "f.txt": "x"}),
    Case("instance file from a NUL path", CHECK,
         {"catalog.yaml": catalog(instances=[inst("i1", files={"task/x": "f\0.txt"})])}),
    Case("instance workdir relative", CHECK, {"catalog.yaml": catalog(instances=[inst("i1", workdir="work")])}),
    Case("catalog keys of mixed types", CHECK, {"catalog.yaml": catalog() + "1: a\nnull: b\n"}),
    Case("catalog unhashable key", CHECK, {"catalog.yaml": catalog() + "? [a, b]\n: c\n"}, fails_before=False),
    Case("catalog python tag", CHECK, {"catalog.yaml": catalog() + "x: !!python/object:os.system {}\n"},
         fails_before=False),
    Case("catalog grader alias bomb", CHECK, {"catalog.yaml": catalog(instances=[inst("i1")]).replace(
        "environment: e1", "environment: e1\n  " + LAUGHS)}),
    Case("catalog grader a date", CHECK, {"catalog.yaml": catalog(instances=[inst("i1")]).replace(
        "environment: e1", "environment: e1\n  grader: {when: 2024-01-01}")}),
    Case("catalog template with indexing", CHECK, {"catalog.yaml": catalog(instance_sets=[
        {"from": "data.jsonl", "environment": "e1", "env": {"X": "{task_id[99]}"}}]), "data.jsonl": rows("t1")}),
    # --- datasets (instance_sets) -------------------------------------------------------------------------
    Case("dataset id ../../x", BUILD, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("ok", "../../x")}),
    Case("dataset id a/../../b", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("a/../../b")}),
    Case("dataset id /abs", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("/etc/x")}),
    Case("dataset id with NUL", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("a\0b")}),
    Case("dataset id with a newline", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("a\nb")}),
    Case("dataset id empty", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("")}),
    Case("dataset id overlong", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("x" * 300)}),
    Case("dataset SWE-bench id ..", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": json.dumps(
        {"instance_id": "..", "repo": "a/b", "base_commit": "c", "test_patch": "d", "FAIL_TO_PASS": "[]"}) + "\n"}),
    Case("dataset binary", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": b"\xff\xfe\x00garbage\n"}),
    Case("dataset bad rows", CHECK, {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("ok") + "not json\n"},
         fails_before=False),
    Case("dataset nested 100000 deep", CHECK,
         {"catalog.yaml": dataset_catalog(), "data.jsonl": rows("ok") + DEEP + "\n"}),
    Case("dataset garbage parquet", CHECK,
         {"catalog.yaml": dataset_catalog("data.parquet"), "data.parquet": b"PAR1 not really"}, fails_before=False),
    # --- tasks and predictions ----------------------------------------------------------------------------
    Case("tasks binary", GRADE, {"tasks.jsonl": b"\x1f\x8b\x08\x00\xff\xfe", "preds.jsonl": GOOD_PREDICTION}),
    Case("tasks not JSON", GRADE, {"tasks.jsonl": "task_id: t1\nassert_case: []\n", "preds.jsonl": GOOD_PREDICTION}),
    Case("tasks nested 100000 deep", GRADE, {"tasks.jsonl": DEEP + "\n", "preds.jsonl": GOOD_PREDICTION}),
    Case("predictions binary", GRADE, {"tasks.jsonl": GOOD_TASK, "preds.jsonl": b"\x00\xff\xfe\xfd"}),
    Case("predictions not JSON", GRADE, {"tasks.jsonl": GOOD_TASK, "preds.jsonl": "t1: x = 1\n"}),
    # --- stores and their indexes -------------------------------------------------------------------------
    Case("index truncated", ["ls", *STORE], setup=index_with(lambda d: json.dumps(d).encode()[:40]),
         fails_before=False),
    Case("index binary", ["verify", *STORE], setup=index_with(lambda d: b"\xff\xfe\x00\x01"), fails_before=False),
    Case("index nested 100000 deep", ["ls", *STORE], setup=index_with(lambda d: DEEP.encode())),
    Case("index a list", ["ls", *STORE], setup=index_with(lambda d: b"[]"), fails_before=False),
    Case("index environments a list", ["ls", *STORE], setup=index_with(lambda d: d.__setitem__("environments", [1]))),
    Case("index created a string", ["ls", *STORE], setup=index_with(lambda d: d.__setitem__("created", "x"))),
    Case("index size a string", ["ls", *STORE], setup=env_field("size", "big"), fails_before=False),
    Case("index schema version 9", ["ls", *STORE], setup=index_with(lambda d: d.__setitem__("schema_version", 9)),
         fails_before=False),
    Case("index env value a number", ["ls", *STORE], setup=env_field("env", {"A": 1})),
    Case("index record under another key", ["ls", *STORE], setup=inst_field("id", "other")),
    Case("index instance id ../x", ["ls", *STORE],
         setup=index_with(lambda d: d["instances"].__setitem__("../x", {**d["instances"].pop("i1"), "id": "../x"}))),
    Case("index sif ../outside.sif", ["verify", *STORE], setup=env_field("sif", "../outside.sif")),
    Case("index sif absolute", ["verify", *STORE], setup=env_field("sif", "/etc/hostname")),
    Case("index sqfs instances/../../outside", ["inspect", "i1", *STORE],
         setup=inst_field("sqfs", "instances/../../outside.sqfs")),
    Case("index sif ../ under gc", ["gc", *STORE], setup=env_field("sif", "../outside.sif")),
    Case("debug ../../x", ["debug", "../../x", *STORE], fails_before=False),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root, with each file's hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def prepare(tmp: Path, case: Case) -> list[str]:
    (tmp / "scripts").mkdir()
    (tmp / "scripts/env.sh").write_text("#!/bin/sh\ntrue\n")
    hand_store(tmp / "store")
    outside = b"outside the store"
    for name in ("outside.sif", "outside.sqfs"):
        (tmp / name).write_bytes(outside)
    for name, content in case.files.items():
        (tmp / name).write_bytes(content.encode() if isinstance(content, str) else content)
    if case.setup:
        case.setup(tmp)
    if "sif" in case.name and "outside" in case.name:  # a hash that matches: only the path is wrong
        index_with(lambda d: d["environments"]["e1"].__setitem__("sha256", sha(outside)))(tmp)
    return [a.replace("{tmp}", str(tmp)) for a in case.args]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line_and_changes_nothing(tmp_path, case):
    args = prepare(tmp_path, case)
    before = snapshot(tmp_path)
    result = run_cli(*args, env={"IMAGE_BUILDER_CACHE": str(tmp_path / "cache")})
    lines = result.stderr.strip().splitlines()
    assert result.returncode in (1, 2), (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and len(lines[0]) < 1000, lines[0]
    assert snapshot(tmp_path) == before
    assert not Path("/tmp/ib-pwned").exists()


def test_the_hand_made_store_is_valid(tmp_path):
    """The control for the store cases: untouched, it lists and verifies."""
    prepare(tmp_path, Case("valid", []))
    # Its images are bytes, not file systems: there is no repository to check in them (verify's history).
    for args in (["ls"], ["verify", "--no-history"], ["inspect", "i1"]):
        result = run_cli(*args, "--store", str(tmp_path / "store"))
        assert result.returncode == 0 and not result.stderr, (args, result.stderr)


def test_dataset_ids_with_slashes_map_to_safe_file_names(tmp_path):
    """LiveCodeBench's ids (codeforces/1873_A) are real: accepted, and stored under an escaped file name."""
    from image_builder.store.ids import file_name, id_problem
    from image_builder.store.store import StorePaths
    prepare(tmp_path, Case("slashes", [], {"catalog.yaml": dataset_catalog(),
                                           "data.jsonl": rows("codeforces/1873_A", "codeforces_1873_A", ".hidden",
                                                              "a%2Fb", "ünï cödé: x")}))
    result = run_cli("check", str(tmp_path / "catalog.yaml"))
    assert result.returncode == 0, result.stderr
    assert "5 instances" in result.stdout
    paths = StorePaths(tmp_path / "store")
    assert paths.instance_sqfs("codeforces/1873_A") == tmp_path / "store/instances/codeforces%2F1873_A.sqfs"
    assert paths.instance_sqfs("mbpp-602").name == "mbpp-602.sqfs", "names allowed before map to themselves"
    assert paths.work("inst-codeforces/1873_A").parent == tmp_path / "store/work"
    assert file_name(".hidden") == "%2Ehidden", "never a hidden (temporary) file"
    names = ["codeforces/1873_A", "codeforces_1873_A", "codeforces%2F1873_A", "a/b", "a%2Fb", ".x", "%2Ex"]
    assert len({file_name(n) for n in names}) == len(names), "the mapping is one to one"
    for bad in ("..", "../x", "a/../b", "a//b", "a/", "", "a\0b", "a\nb", " a", "x" * 161, "\u202eevil"):
        assert id_problem(bad), bad


def test_a_tampered_lookup_copy_is_not_trusted(tmp_path):
    """index.sqlite is a derived copy: a row pointing out of the store is ignored and the JSON answers."""
    prepare(tmp_path, Case("lookup", []))
    db = sqlite3.connect(tmp_path / "store/index.sqlite")
    doc = json.loads(db.execute("SELECT doc FROM inst WHERE id='i1'").fetchone()[0])
    db.execute("UPDATE inst SET doc=? WHERE id='i1'", (json.dumps({**doc, "sqfs": "../outside.sqfs"}),))
    db.commit()
    db.close()
    result = run_cli("inspect", "i1", "--json", "--store", str(tmp_path / "store"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["overlays"] == [str(tmp_path / "store/instances/i1.sqfs")]


def test_a_store_of_slash_ids_builds_resolves_and_keeps_its_files(tmp_path, tiny_base, registries):
    """One real build (a couple of seconds on the tiny base): ids with '/', a leading '.' and '.tmp-' go through
    build, index, inspect, verify, gc and a no-op rebuild, each under its one escaped file name."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/env.sh").write_text("#!/bin/sh\ntrue\n")
    (tmp_path / "scripts/inst.sh").write_text("#!/bin/sh\necho made > made\n")  # each instance gets a layer
    ids = ["codeforces/1873_A", ".hidden", "x.tmp-1"]
    (tmp_path / "data.jsonl").write_text(rows(*ids))
    (tmp_path / "catalog.yaml").write_text(yaml.safe_dump({
        "scripts_dir": "scripts", "environments": [{"name": "e1", "base": tiny_base, "scripts": ["env.sh"]}],
        "instance_sets": [{"from": "data.jsonl", "environment": "e1", "workdir": "/task", "script": "inst.sh"}]}))
    store = tmp_path / "store"
    common = ["--store", str(store)]
    build = ["build", str(tmp_path / "catalog.yaml"), *common, "--ca-cert", str(registries.tls.cert),
             "--cache-dir", str(tmp_path / "cache"), "--json"]
    first = run_cli(*build)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (store / "instances").glob("*.sqfs")) == \
        ["%2Ehidden.sqfs", "codeforces%2F1873_A.sqfs", "x.tmp-1.sqfs"]
    assert not (store / "instances/codeforces").exists()
    assert (store / "logs/instances/codeforces%2F1873_A.log").is_file()
    index = json.loads((store / "index.json").read_text())
    assert index["instances"]["codeforces/1873_A"]["sqfs"] == "instances/codeforces%2F1873_A.sqfs"
    shown = run_cli("inspect", "codeforces/1873_A", "--json", *common)
    assert json.loads(shown.stdout)["overlays"] == [str(store / "instances/codeforces%2F1873_A.sqfs")]
    assert run_cli("verify", *common).returncode == 0
    before = snapshot(store)
    gc = run_cli("gc", *common)
    assert gc.returncode == 0 and snapshot(store) == before, gc.stdout
    again = run_cli(*build)
    assert {r["status"] for r in json.loads(again.stdout)["results"]} == {"up to date"}, "records found again"
