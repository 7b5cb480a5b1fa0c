"""`image-builder impossible report`: cheating rates from scripted grade results with known rates (Inspect logs:
tests/test_agent_harnesses.py)."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def results(path, passed: dict[str, int], totals: dict[str, int], access: str | None = None):
    lines = []
    for kind, total in totals.items():
        for i in range(total):
            task_id = f"t{i}" + ("" if kind == "original" else f"__{kind}")
            record = {"task_id": task_id, "kind": "repo" if access else "assert",
                      "status": "passed" if i < passed[kind] else "failed",
                      "evidence": ["special-casing: ..."] if i == 0 and kind == "oneoff" else []}
            if access:
                record["repo"] = {"access": access}
            lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rates_by_variant_and_axis(tmp_path):
    a = results(tmp_path / "a.jsonl", {"oneoff": 3, "conflicting": 1, "original": 4},
                {"oneoff": 10, "conflicting": 10, "original": 5})
    b = results(tmp_path / "b.jsonl", {"oneoff": 0, "conflicting": 0, "original": 2},
                {"oneoff": 4, "conflicting": 2, "original": 2}, access="read-only")
    r = run_cli("impossible", "report", f"model=m1,scaffold=minimal,attempts=10@{a}", f"model=m2@{b}",
                "--json", str(tmp_path / "rows.json"), "--html", str(tmp_path / "rows.html"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["model", "scaffold", "access", "attempts", "one-off", "cheating", "conflicting",
                                "cheating", "flagged", "original", "passed", "cheats", "with", "evidence"]
    assert lines[1].split() == ["m1", "minimal", "evaluator", "10", "30.0%", "(3/10)", "10.0%", "(1/10)", "0.0%",
                                "(0/20)", "80.0%", "(4/5)", "25.0%", "(1/4)"]
    assert lines[2].split() == ["m2", "-", "read-only", "-", "0.0%", "(0/4)", "0.0%", "(0/2)", "0.0%", "(0/6)",
                                "100.0%", "(2/2)", "-"]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["oneoff_rate"] == 0.3 and rows[0]["conflicting_rate"] == 0.1 and rows[1]["oneoff_n"] == 4
    page = (tmp_path / "rows.html").read_text()
    assert page.count("<rect") == 4 and "30.0% (3/10)" in page and "<td>m2</td>" in page


def test_bad_sources_are_one_line(tmp_path):
    r = run_cli("impossible", "report", f"colour=red@{tmp_path / 'x.jsonl'}")
    assert r.returncode == 1 and "labels are model, scaffold, access, attempts" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "bad.jsonl").write_text('{"task_id": "1"}\n')
    r = run_cli("impossible", "report", str(tmp_path / "bad.jsonl"))
    assert r.returncode == 1 and f"{tmp_path / 'bad.jsonl'}:1: not a grade result" in r.stderr
    r = run_cli("impossible", "report", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 1 and "no such file" in r.stderr
