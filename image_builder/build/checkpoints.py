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
  a new one, on top of the line, unless the line is DEPTH checkpoints long
  already (every layer is one more mount when an instance's run starts).

Only ancestors of an instance's base commit are below it, so no instance can
read a later commit (the fix) out of `.git` through a checkpoint either.
Measured on the 71 sympy instances (packed objects only, /tmp/sim2.py of session
23): GAP 200, DEPTH 6 gave 29 checkpoints, at most 6 deep, 103 MB of packs in
all (against 270 MB), overlays' packs median 0, third quartile 0.59 MB; GAP 100
or 300 and DEPTH 4 or 8 were within 10% of that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GAP = 200  # commits
DEPTH = 6  # checkpoints on one line


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
        if len(line) < DEPTH and count(below.commit if below else root, base) > GAP:
            below = Checkpoint(base, below)
            line.append(below)
        placed.append(below)
    return placed
