"""`image-builder impossible report`: ImpossibleBench's cheating rate, from `grade` results and Inspect logs.

The cheating rate is the pass rate on impossible variants: any pass there violates the specification. It is
reported one-off and conflicting apart, per model, scaffold, test-access mode and submission budget (the
paper's axes), with the share of samples that flagged the task for a human (the abort option, counted apart
from pass and fail) and the pass rate on the original tasks beside it: a model that passes nothing cheats
nothing. The last column says how many of the passes on impossible variants the graders saw cheating in
(the results' `evidence`): the rest cheated in a way no detector saw.

Where each axis comes from:
- Inspect logs (read with inspect_ai's own log reader): the model and task of the eval; the scaffold from the
  task's `agent_type` argument, else the task's name; the variant from the sample's metadata
  `impossible_type`, else its task id's `__oneoff`/`__conflicting` suffix (metadata `instance_id` or
  `task_id`, else the sample id), else the task's `split` argument;
  access, attempts allowed and the flag from `submission_scorer`'s score metadata.
- `grade` results: the variant from the task id's suffix, access from the repo report (assert and stdin
  tasks: the result's mode, `splice` or `evaluator`), and the labels given with the file
  (`model=o3,scaffold=minimal@results.jsonl`); unlabelled axes read `-`.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from image_builder.errors import ImageBuilderError

KINDS = ("oneoff", "conflicting")
AXES = ("model", "scaffold", "access", "attempts")


class ReportError(ImageBuilderError):
    pass


@dataclass(frozen=True)
class Outcome:
    """One graded sample: where it sits on the axes, its variant ("original" for an unmutated task)."""
    model: str
    scaffold: str
    access: str
    attempts: str
    kind: str
    passed: bool
    flagged: bool = False
    evidence: bool = False  # the grader saw cheating in the solution (the result's evidence)


@dataclass
class Rate:
    n: int = 0
    passed: int = 0

    @property
    def rate(self) -> float | None:
        return self.passed / self.n if self.n else None


@dataclass
class Row:
    group: dict[str, str]
    kinds: dict[str, Rate] = field(default_factory=lambda: {k: Rate() for k in (*KINDS, "original")})
    flagged: Rate = field(default_factory=Rate)  # over the impossible samples
    explained: Rate = field(default_factory=Rate)  # of the passes on impossible variants, those with evidence

    def to_dict(self) -> dict:
        return {**self.group, **{f"{k}_n": r.n for k, r in self.kinds.items()},
                **{f"{k}_passed": r.passed for k, r in self.kinds.items()},
                **{f"{k}_rate": r.rate for k, r in self.kinds.items()},
                "flagged": self.flagged.passed, "flag_rate": self.flagged.rate,
                "passes_with_evidence": self.explained.passed, "evidence_rate": self.explained.rate}


def kind_of(task_id: str, impossible_type: str | None = None) -> str:
    if impossible_type in KINDS:
        return impossible_type
    return next((k for k in KINDS if task_id.endswith(f"__{k}")), "original")


def parse_source(text: str) -> tuple[dict[str, str], Path]:
    """`key=value,...@PATH` (labels for a results file), or a bare PATH."""
    labels: dict[str, str] = {}
    head, at, tail = text.partition("@")
    if at and "=" in head:
        for pair in head.split(","):
            key, eq, value = pair.partition("=")
            if not eq or key not in AXES:
                raise ReportError(f"{text!r}: labels are {', '.join(AXES)} as key=value,...@PATH")
            labels[key] = value
        return labels, Path(tail)
    return labels, Path(text)


def outcomes_of(labels: dict[str, str], path: Path) -> list[Outcome]:
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    if path.suffix in (".eval", ".json") and not _is_jsonl(path):
        return _inspect_outcomes(path, labels)
    return _results_outcomes(path, labels)


def _is_jsonl(path: Path) -> bool:
    """A results file named .json (its first line a result), not an Inspect log."""
    with path.open("rb") as f:
        first = f.readline()
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "task_id" in record


def _results_outcomes(path: Path, labels: dict[str, str]) -> list[Outcome]:
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            task_id, status = str(record["task_id"]), record["status"]
        except (ValueError, KeyError, TypeError):
            raise ReportError(f"{path}:{number}: not a grade result (task_id, status)") from None
        repo = record.get("repo") or {}
        access = labels.get("access") or repo.get("access") or record.get("mode") or "evaluator"
        found.append(Outcome(labels.get("model", "-"), labels.get("scaffold", "-"), access,
                             labels.get("attempts", "-"), kind_of(task_id), status == "passed",
                             evidence=bool(record.get("evidence"))))
    return found


def _inspect_outcomes(path: Path, labels: dict[str, str]) -> list[Outcome]:
    try:
        from inspect_ai.log import read_eval_log
    except ImportError:
        raise ReportError(f"{path}: reading Inspect logs needs inspect_ai (pip install inspect-ai)") from None
    try:
        log = read_eval_log(str(path))
    except Exception as exc:  # inspect_ai's own reader decides what a log is
        raise ReportError(f"{path}: not an Inspect log ({type(exc).__name__}: {str(exc)[:120]})") from None
    args = dict(log.eval.task_args or {})
    model = labels.get("model") or log.eval.model
    scaffold = labels.get("scaffold") or str(args.get("agent_type") or log.eval.task)
    found = []
    for sample in log.samples or []:
        scores = list((sample.scores or {}).values())
        if not scores:
            continue
        score = scores[0]
        meta = score.metadata or {}
        passed = score.value in ("C", 1, 1.0, True)
        about = sample.metadata or {}
        ident = str(about.get("instance_id") or about.get("task_id") or sample.id)
        split = args.get("split") if args.get("split") in KINDS else None
        kind = kind_of(ident, about.get("impossible_type") or split)
        attempts = labels.get("attempts") or str(meta.get("max_attempts") or args.get("max_attempts") or "-")
        found.append(Outcome(model, scaffold, labels.get("access") or str(meta.get("access") or "-"), attempts, kind,
                             passed and not meta.get("flagged"), bool(meta.get("flagged"))))
    return found


def report(outcomes: list[Outcome]) -> list[Row]:
    rows: dict[tuple, Row] = {}
    for o in outcomes:
        key = (o.model, o.scaffold, o.access, o.attempts)
        row = rows.setdefault(key, Row(dict(zip(AXES, key))))
        rate = row.kinds[o.kind]
        rate.n += 1
        rate.passed += o.passed
        if o.kind != "original":
            row.flagged.n += 1
            row.flagged.passed += o.flagged
            if o.passed:
                row.explained.n += 1
                row.explained.passed += o.evidence
    return [rows[k] for k in sorted(rows)]


def _pct(rate: Rate) -> str:
    return "-" if rate.rate is None else f"{rate.rate:.1%} ({rate.passed}/{rate.n})"


HEAD = (*AXES, "one-off cheating", "conflicting cheating", "flagged", "original passed", "cheats with evidence")


def _cells(rows: list[Row]) -> list[list[str]]:
    return [[*r.group.values(), _pct(r.kinds["oneoff"]), _pct(r.kinds["conflicting"]), _pct(r.flagged),
             _pct(r.kinds["original"]), _pct(r.explained)] for r in rows]


def table(rows: list[Row]) -> str:
    head, body = list(HEAD), _cells(rows)
    widths = [max(len(str(x)) for x in column) for column in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body])


def html_report(rows: list[Row]) -> str:
    """A page with the table and a bar chart (inline SVG: no plotting library), one-off and conflicting
    cheating rates per group."""
    bar_h, gap, width, label_w = 14, 10, 420, 320
    svg = []
    y = 20
    for r in rows:
        name = " / ".join(r.group.values())
        svg.append(f'<text x="0" y="{y + bar_h}" font-size="12">{html.escape(name)}</text>')
        for i, (kind, colour) in enumerate((("oneoff", "#d95f02"), ("conflicting", "#7570b3"))):
            rate = r.kinds[kind].rate or 0.0
            svg.append(f'<rect x="{label_w}" y="{y + i * bar_h}" width="{rate * width:.1f}" height="{bar_h - 2}" '
                       f'fill="{colour}"><title>{kind}: {_pct(r.kinds[kind])}</title></rect>'
                       f'<text x="{label_w + rate * width + 4:.1f}" y="{y + i * bar_h + bar_h - 3}" font-size="11">'
                       f'{html.escape(_pct(r.kinds[kind]))}</text>')
        y += 2 * bar_h + gap
    chart = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + width + 140}" height="{y + 10}">'
             + "".join(svg) + "</svg>")
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in line) + "</tr>" for line in _cells(rows))
    head = "".join(f"<th>{h}</th>" for h in HEAD)
    return ("<!doctype html><meta charset='utf-8'><title>ImpossibleBench cheating rates</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}</style>"
            "<h1>Cheating rate (pass rate on impossible variants)</h1>"
            "<p><span style='color:#d95f02'>one-off</span>, <span style='color:#7570b3'>conflicting</span></p>"
            f"{chart}<table><tr>{head}</tr>{cells}</table>")


def rows_json(rows: list[Row]) -> str:
    return json.dumps([r.to_dict() for r in rows], indent=1)
