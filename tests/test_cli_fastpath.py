"""`image-builder run`'s and `sandbox exec`'s fast path (image_builder.entry, cli_run.parse and
parse_exec): the parameters click would give, for the argv click accepts, and None (left to click)
for everything else; no click imported on the way to a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from image_builder import cli_run
from image_builder.cli import run
from image_builder.cli_sandbox import sandbox_exec

ROOT = Path(__file__).resolve().parents[1]


def click_params(args: list[str], command=run) -> dict | None:
    try:
        with command.make_context(command.name, list(args)) as ctx:
            return dict(ctx.params)
    except click.exceptions.Exit:  # --help
        return None
    except click.ClickException:
        return None


ACCEPTED = [
    ["inst"],
    ["inst", "--", "python3", "-c", "pass"],
    ["inst", "python3", "--net", "-e", "X=1"],
    ["--store", "S", "inst", "--", "true"],
    ["--store=S", "--net", "--json", "inst", "true"],
    ["--timeout", "2.5", "--memory", "512", "inst", "true"],
    ["--timeout=1e3", "--memory=1", "inst"],
    ["--bind", "/tmp:/x", "--bind=/a:/b:rw", "--bind", "a:/c:ro", "inst"],
    ["-e", "A=1", "-eB=2", "--env", "C=3", "--env=D", "-e=E", "inst"],
    ["--workdir", "/w", "--backend", "userns", "inst"],
    ["--backend=kernel", "--max-output", "64K", "inst"],
    ["--max-output", "0", "--output-dir", "out", "--json", "inst"],
    ["--max-output=10mb", "inst", "x"],
    ["--store", "-weird", "inst"],
    ["--workdir", "--net", "inst"],  # an option's value is the next word, whatever it looks like
    ["--net", "--net", "--store", "a", "--store", "b", "inst"],  # the last of a single-valued option
    ["-", "x"],
]

REFUSED = [
    [], ["--help"], ["--help", "inst"], ["--", "inst", "true"], ["--nett", "inst"],
    ["--net=1", "inst"], ["--timeout", "0", "inst"], ["--timeout", "-1", "inst"], ["--timeout", "x", "inst"],
    ["--memory", "0", "inst"], ["--memory", "1.5", "inst"], ["--backend", "proot", "inst"],
    ["--max-output", "lots", "inst"], ["--max-output", "-1", "inst"], ["--bind", "/a", "inst"],
    ["--bind", "/a:b", "inst"], ["--bind", "/a:/b:rx", "inst"], ["--store"], ["--store", "S"], ["-x", "inst"],
    ["--store", "pyproject.toml", "inst"], ["--output-dir", "pyproject.toml", "inst"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=" ".join)
def test_parse_reads_as_click(args, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("IMAGE_BUILDER_STORE", raising=False)
    expected = click_params(args)
    assert expected is not None, "click refuses it"
    assert cli_run.parse(args) == expected


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_parse_leaves_the_rest_to_click(args, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("IMAGE_BUILDER_STORE", raising=False)
    assert cli_run.parse(args) is None


EXEC_ACCEPTED = [
    ["box", "true"], ["box", "--", "python3", "-c", "pass"], ["box", "ls", "--timeout", "1"],
    ["--timeout", "2.5", "-e", "A=1", "-eB=2", "--env=C=3", "box", "env"], ["--cwd", "sub", "box", "pwd"],
    ["--cwd=--x", "--max-output", "64K", "--backend", "userns", "box", "x"], ["--backend=kernel", "box", "-"],
    ["--timeout", "1", "--timeout", "3", "box", "x"],
]
EXEC_REFUSED = [
    [], ["box"], ["--help"], ["--", "box", "true"], ["--net", "box", "true"],
    ["--timeout", "0", "box", "x"], ["--timeout", "nan", "box", "x"], ["--max-output", "lots", "box", "x"],
    ["--backend", "apptainer", "box", "x"], ["--cwd"], ["-x", "box", "y"],
]


@pytest.mark.parametrize("args", EXEC_ACCEPTED, ids=" ".join)
def test_parse_exec_reads_as_click(args):
    expected = click_params(args, sandbox_exec)
    assert expected is not None, "click refuses it"
    assert cli_run.parse_exec(args) == expected


@pytest.mark.parametrize("args", EXEC_REFUSED, ids=" ".join)
def test_parse_exec_leaves_the_rest_to_click(args):
    assert cli_run.parse_exec(args) is None


def test_store_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    for value in (str(tmp_path), ""):
        monkeypatch.setenv("IMAGE_BUILDER_STORE", value)
        assert cli_run.parse(["inst"]) == click_params(["inst"])
    monkeypatch.setenv("IMAGE_BUILDER_STORE", "pyproject.toml")
    assert cli_run.parse(["inst"]) is None and click_params(["inst"]) is None


PROBE = """
import sys
from image_builder import entry
sys.argv = ["image-builder", *sys.argv[1:]]
try:
    entry.main()
finally:
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"click", "rich", "requests", "zstandard", "yaml",
                                                            "tenacity"})
    print("HEAVY", *heavy, file=sys.stderr)
"""


def entry(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_the_fast_path_imports_no_click_and_errs_as_click(tmp_path):
    """A store error on the fast path: click's one line and status, without click; a usage error: click's."""
    fast = entry("run", "--store", str(tmp_path / "none"), "inst", "true", cwd=tmp_path)
    lines = fast.stderr.splitlines()
    assert fast.returncode == 1 and lines[-1] == "HEAVY", fast.stderr
    from click.testing import CliRunner
    from image_builder.cli import main
    slow = CliRunner().invoke(main, ["run", "--store", str(tmp_path / "none"), "inst", "true"])
    assert slow.exit_code == 1 and lines[:-1] == slow.output.splitlines()
    bad = entry("run", "--memory", "x", "inst", cwd=tmp_path)
    assert bad.returncode == 2 and "Invalid value for '--memory'" in bad.stderr and "HEAVY click" in bad.stderr
    # A state dir of this test's: the error names whether this user's holder runs, and other tests start and
    # stop the default dir's holder between the two calls.
    state = {"XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir(mode=0o700)
    box = entry("sandbox", "exec", "--timeout", "5", "no-such-box", "true", cwd=tmp_path, env=state)
    assert box.returncode == 1 and box.stderr.splitlines()[-1] == "HEAVY", box.stderr
    assert box.stderr.startswith("Error: ") and len(box.stderr.splitlines()) == 2, box.stderr
    slow = CliRunner().invoke(main, ["sandbox", "exec", "--timeout", "5", "no-such-box", "true"], env=state)
    assert slow.exit_code == 1 and box.stderr.splitlines()[:-1] == slow.output.splitlines()
    other = entry("--version", cwd=tmp_path)
    assert other.returncode == 0 and "image-builder, version" in other.stdout
