"""verl's reward managers: rows per second of compute_score under each manager's calling convention.

The 40 MBPP sample rows, each twice (its reference solution, which scores 1, and a
wrong answer, 0), scored through image_builder.rewards loaded as verl loads it
and called as each manager calls it (the mirrors of verl's code in
tests/test_verl_managers.py): naive (dapo alike: one row at a time), batch (one
call, rows on threads), prime (a fork-started process pool made per batch, 4
processes), the reward loop (a thread per row, and the `async def` variant).
Every score is checked. The peer is the physical limit without protection: bare
`python3` on the host running each row's solution and its asserts as one
script, 2 at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import Report, Row
from bench.graders import mbpp_store
from image_builder.graders import rewards
from tests.test_verl_managers import (ROWS, batch_manager, batch_of, custom_reward_fn, naive_manager,
                                      prime_manager, reward_loop_manager)

WORKERS = 2


def bare(batch, work: Path) -> float:
    """Each row's response and its asserts, one python3 process a row, WORKERS at a time."""
    import json
    scripts = []
    for i, (row, response, _) in enumerate(batch):
        code = response.split("```python\n", 1)[-1].split("```", 1)[0]
        cases = json.loads(row["reward_model"]["ground_truth"])["assert_case"]
        path = work / f"row{i}.py"
        path.write_text(code + "\n" + "\n".join(cases) + "\n")
        scripts.append(path)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda p: subprocess.run([sys.executable, "-I", str(p)], capture_output=True), scripts))
    return time.perf_counter() - t0


def managers():
    """(name, how the batch is scored: its scores in order)."""
    plain = custom_reward_fn("compute_score")
    return [
        ("naive (dapo alike): one row at a time", lambda b: naive_manager(plain, b)[0]),
        ("batch: compute_score_batch", lambda b: batch_manager(custom_reward_fn("compute_score_batch"), b)[0]),
        ("prime: a process pool of 4 per batch", lambda b: prime_manager(plain, b, num_processes=4)[0]),
        ("reward loop: a thread per row", lambda b: [o["reward_score"] for o in reward_loop_manager(plain, b)]),
        ("reward loop: compute_score_async",
         lambda b: [o["reward_score"] for o in reward_loop_manager(custom_reward_fn("compute_score_async"), b)]),
    ]


def main() -> Report:
    report = Report("rewards")
    batch = batch_of(0, len(ROWS))
    expected = [e for _, _, e in batch]
    with tempfile.TemporaryDirectory(prefix="ib-bench-rewards-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        os.environ[rewards.STORE_ENV] = str(mbpp_store(work))
        os.environ.pop(rewards.INSTANCE_ENV, None)
        (work / "bare").mkdir()
        limit = len(batch) / bare(batch, work / "bare")
        for name, score in managers():
            score(batch[:4])  # warm: the process's sessions opened
            t0 = time.perf_counter()
            scores = score(batch)
            took = time.perf_counter() - t0
            assert scores == expected, (name, [i for i, (s, e) in enumerate(zip(scores, expected)) if s != e][:5])
            report.rows.append(Row(f"{len(batch)} MBPP rows, {name}: rows per second", len(batch) / took,
                                   f"bare python3 on the host, {WORKERS} at a time", limit, "report", "rows/s"))
        report.notes.append("rows: the 40 sample rows twice (reference solution, a wrong answer); each row is an "
                            "evaluator run and a candidate run per assert (3 asserts a row), each in a fresh root, "
                            "cloned from the instance's warm interpreters (runtime/warm.py)")
    return report


if __name__ == "__main__":
    r = main()
    r.print()
    r.save()
