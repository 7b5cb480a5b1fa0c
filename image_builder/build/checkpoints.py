"""Checkpoints: layers between a SWE-bench version's environment and its instances.

An instance's overlay holds the git objects from the layer below it to its base
commit, and the files of its checkout that differ. Over its version's merge-base
that is up to a year of history: the 71 SWE-bench Lite sympy instances' overlays
had a median of 7.2 MB (sympy 1.1: 15 instances 59 to 3,889 commits past the
merge-base, about 5 kB of packed objects a commit), 270 MB of packs in all.
A checkpoint is an instance's base commit made a layer of its own, which later
instances of the same line of history sit on, so each holds only its own steps:

- instances are placed oldest base commit first; each sits on the newest
  checkpoint of the current line that is an ancestor of its base commit (a
  checkpoint that is not is dropped from the line: history branched);
- an instance more than GAP commits past that checkpoint makes its base commit
  the line's next checkpoint, the k-th, unless the line has 2**DEPTH - 1;
- the k-th sits on the (k & (k - 1))-th (the version's environment for 0), as
  a Fenwick tree's nodes do: no instance stacks more than DEPTH checkpoints
  (every layer is one more mount when its run starts), yet a line goes on for
  63 of them instead of 6, each holding the commits since the one it sits on.

Only ancestors of an instance's base commit are below it, so no instance can
read a later commit (the fix) out of `.git` through a checkpoint either.
Measured on the 71 sympy instances of SWE-bench Lite (packed objects only,
/tmp/sim2.py of session 23), a line of DEPTH 6 at GAP 200 gave 29 checkpoints,
103 MB of packs in all (against 270 MB), overlays' packs median 0, third
quartile 0.59 MB. But a version with more instances fills such a line after
1,200 commits and every later instance carries the rest (session 38, commits
an instance holds past its checkpoint, every 10th merge of sympy 1.1 to 1.2:
69 bases over 4,077 commits, about the full SWE-bench's count for sympy 1.1):
a line at GAP 200 median 794, max 2,636 (55,000 commits in the overlays); these
parents at GAP 50 median 0, third quartile 39, max 48, 44 checkpoints holding
13,671, at most 5 deep. Built, 24 sphinx 5.0 instances over 250 commits: overlays
median 2.99 MB at GAP 200, 0.69 MB at GAP 50.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GAP = 50  # commits
DEPTH = 6  # checkpoints an instance stacks, at most


@dataclass(frozen=True)
class Checkpoint:
    commit: str
    parent: Checkpoint | None  # None: it sits on the version's environment


def place(bases: Sequence[str], root: str, is_ancestor: Callable[[str, str], bool],
          count: Callable[[str, str], int]) -> list[Checkpoint | None]:
    """For each base commit, in the order given (oldest first), the checkpoint its instance sits on (None:
    the version's environment, checked out at `root`, an ancestor of all). `count(a, b)`: the commits in
    b's history and not a's."""
    line: list[Checkpoint] = []
    placed: list[Checkpoint | None] = []
    for base in bases:
        while line and not is_ancestor(line[-1].commit, base):
            line.pop()
        below = line[-1] if line else None
        if len(line) < 2 ** DEPTH - 1 and count(below.commit if below else root, base) > GAP:
            k = len(line) + 1
            below = Checkpoint(base, line[(k & (k - 1)) - 1] if k & (k - 1) else None)
            line.append(below)
        placed.append(below)
    return placed
