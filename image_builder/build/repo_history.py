"""An instance's repository holds what SWE-bench's images hold: HEAD and its ancestors.

SWE-bench deletes a repository's later history from its images (the fix of an
instance is a later commit, its hidden tests a later blob: one `git log --all -S`
finds them). HISTORY_SCRIPT does that here, for every way an instance gets its
repository: run in the build sandbox after each instance's script (instances.py:
a clone by swebench-instance.sh, a checkout over a swebench-repo.sh environment,
any hand-written catalog's script) and over each imported image (imports.py). In
the instance's workdir repository it leaves
- refs: HEAD's branch (if HEAD is one) and the tags on HEAD's ancestors (as SWE-bench
  keeps older tags: setuptools_scm reads versions from them); no other branch, tag,
  remote, stash, note or replace ref;
- no reflog, ORIG_HEAD, FETCH_HEAD or other pseudo-ref, no linked worktree, graft or
  alternate object store, nor commit-graph naming gone commits;
- objects: only those reachable from the above and the index. Where others are held
  (a full clone, an environment layer holding more), everything reachable is repacked
  into one pack and the rest pruned; where none are (the cut bundles of `swebench
  catalog`), nothing is written.
It runs the image's own git, in the sandbox, with hooks and fsmonitor off: the
repository is untrusted. `check` reports, in one line, what breaks the rule;
`image-builder verify` runs it in every instance (check_instance).
"""

from __future__ import annotations

import hashlib
import shlex

from image_builder.store.ids import shown_id
from image_builder.store.store import ResolvedInstance, Store, VerifyReport

IN_SANDBOX = "/tmp/.image-builder/repo-history.sh"
STAGED_AS = "repo-history.sh"  # under /tmp/.image-builder, as the build sandbox stages files

# sh repo-history.sh prune|check DIR [BASE_COMMIT]
# Cost per instance (Debian bookworm's git 2.39, 2 shared cores): after swebench-instance.sh's clone of
# marshmallow (2,686 commits, 29 of them not ancestors of marshmallow-1359's base; the clone took 0.4 s), the
# refs dropped, the 2,657 ancestors' 12,890 objects repacked and the rest pruned: 0.2 s; where there is
# nothing to drop (a `swebench catalog` checkout), the counts alone: 0.1 s.
HISTORY_SCRIPT = r"""set -eu
mode=$1 dir=$2 want=${3:-}
cd "$dir" 2>/dev/null || exit 0
[ -e .git ] || exit 0
# The repository's own settings may run commands (hooks, fsmonitor) or redirect git: none of them here.
unset GIT_DIR GIT_WORK_TREE GIT_COMMON_DIR GIT_INDEX_FILE GIT_OBJECT_DIRECTORY GIT_ALTERNATE_OBJECT_DIRECTORIES \
    GIT_NAMESPACE GIT_REPLACE_REF_BASE GIT_SHALLOW_FILE GIT_GRAFT_FILE GIT_CONFIG GIT_CONFIG_PARAMETERS \
    GIT_CONFIG_COUNT GIT_CEILING_DIRECTORIES
export GIT_NO_REPLACE_OBJECTS=1 GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0 LC_ALL=C
say() { echo "image-builder: $dir/.git: $*" >&2; }
command -v git >/dev/null 2>&1 || { say "the image has no git to prune or check its history with: add git to it"; exit 1; }
g() { git -c core.hooksPath=/dev/null -c core.fsmonitor= -c gc.auto=0 -c maintenance.auto=false "$@"; }
G=$(cd "$(g rev-parse --git-common-dir)" && pwd -P) || { say "not a repository git can read"; exit 1; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
head=$(g rev-parse -q --verify 'HEAD^{commit}' || true)
branch=$(g symbolic-ref -q HEAD || true)
# What stays besides HEAD: its branch, and tags on its ancestors.
if [ -n "$head" ]; then
    { [ -z "$branch" ] || echo "$branch"; g for-each-ref --merged "$head" --format='%(refname)' refs/tags/; } > "$T/keep"
else
    : > "$T/keep"
fi
# Every other ref: as git lists them, and loose ref files it skips (broken, misnamed).
extra_refs() {
    { g for-each-ref --format='%(refname)'; if [ -d "$G/refs/heads" ]; then (cd "$G" && find refs -type f); fi; } \
        | sort -u | grep -vxF -f "$T/keep" > "$T/drop" || true
}
STATE="logs ORIG_HEAD FETCH_HEAD MERGE_HEAD MERGE_MSG COMMIT_EDITMSG TAG_EDITMSG SQUASH_MSG CHERRY_PICK_HEAD REVERT_HEAD AUTO_MERGE BISECT_LOG BISECT_START
BISECT_EXPECTED_REV BISECT_TERMS BISECT_NAMES BISECT_ANCESTORS_OK rebase-merge rebase-apply sequencer worktrees remotes
info/grafts info/refs objects/info/alternates objects/info/http-alternates"
counts() {
    g cat-file --batch-all-objects --batch-check='%(objecttype)' > "$T/all" || { say "git cannot list its objects"; exit 1; }
    g rev-list --objects --all --indexed-objects > "$T/reachable" || { say "the repository is incomplete"; exit 1; }
    objects=$(wc -l < "$T/all") reachable=$(wc -l < "$T/reachable")
    commits=$(grep -c '^commit$' "$T/all" || true)
    ancestors=0
    if [ -n "$head" ]; then ancestors=$(g rev-list --count "$head"); fi
}

if [ "$mode" = prune ]; then
    extra_refs
    if [ -s "$T/drop" ]; then
        g for-each-ref --format='delete %(refname)' $(cat "$T/drop") | g update-ref --no-deref --stdin
        (cd "$G" && while IFS= read -r ref; do rm -f "$ref"; done < "$T/drop")  # what update-ref would not take
    fi
    g remote | while IFS= read -r r; do g config --remove-section "remote.$r" 2>/dev/null || true; done
    for f in "$G"/branches/*; do if [ -e "$f" ]; then rm -rf "$f"; fi; done  # remotes of git's first days
    for f in $STATE; do
        case $f in objects/info/alternates|objects/info/http-alternates) continue ;; esac  # after the repack
        if [ -e "$G/$f" ] || [ -L "$G/$f" ]; then rm -rf "$G/$f"; fi
    done
    counts
    if [ "$objects" != "$reachable" ] || [ -e "$G/objects/info/alternates" ] || [ -e "$G/objects/info/http-alternates" ]; then
        rm -f "$G"/objects/pack/*.keep  # a kept pack would outlive the repack
        g repack -a -d -n -q  # not -l: what only an alternate holds is copied in before it goes; -n: no info/refs
        rm -rf "$G/objects/info/alternates" "$G/objects/info/http-alternates" "$G/objects/info/commit-graph" \
            "$G/objects/info/commit-graphs" "$G/objects/pack/multi-pack-index"
        g prune --expire=now
    fi
    mode=check
fi

# check: one line of what breaks the rule, exit 1; nothing when all is well.
counts
extra_refs
problems=""
add() { problems="${problems:+$problems, }$*"; }
if [ -n "$want" ] && [ "$head" != "$want" ]; then add "HEAD is ${head:-unborn}, not the base commit $want"; fi
[ "$commits" = "$ancestors" ] || add "$((commits - ancestors)) commits that are not HEAD or its ancestors"
[ "$objects" = "$reachable" ] || add "$((objects - reachable)) objects that neither HEAD nor its tags reach"
[ ! -s "$T/drop" ] || add "$(wc -l < "$T/drop") refs besides HEAD's branch and its tags ($(head -n 3 "$T/drop" | tr '\n' ' ')...)"
remotes=$(g remote | tr '\n' ' ')
[ -z "$remotes" ] || add "remotes: $remotes"
left=""
for f in $STATE; do if [ -e "$G/$f" ] || [ -L "$G/$f" ]; then left="$left $f"; fi; done
[ -z "$left" ] || add "left:$left"
if [ -n "$problems" ]; then echo "$dir/.git: $problems"; exit 1; fi
"""


def script_digest() -> str:
    """Part of instance keys: a changed script rebuilds (and re-imports) every instance."""
    return hashlib.sha256(HISTORY_SCRIPT.encode()).hexdigest()


def prune_command(workdir: str) -> str:
    """The build sandbox's step: prune the workdir's repository, then check it."""
    return f"/bin/sh {IN_SANDBOX} prune {shlex.quote(workdir)}"


def check_instance(resolved: ResolvedInstance) -> str | None:
    """What breaks the rule in the instance's workdir repository, in one line; None when nothing does
    (or the workdir holds no repository)."""
    from image_builder.runtime.backends import open_session
    from image_builder.runtime.execution import RunRequest
    from image_builder.runtime.session import InstanceLayers

    base = resolved.grader.get("base_commit")
    argv = ["/bin/sh", "-c", HISTORY_SCRIPT, "repo-history", "check", resolved.workdir,
            *([base] if isinstance(base, str) else [])]
    with open_session(InstanceLayers(resolved.env_sif, resolved.overlays, resolved.env, resolved.workdir)) as session:
        result = session.run(RunRequest(tuple(argv), timeout=300))
    if result.exit_code == 0 or result.start_errno is not None:
        return None  # all is well, or an image without /bin/sh: nothing in it runs git either
    for out in (result.stdout, result.stderr):  # its verdict, else why it could not give one
        if lines := out.decode(errors="replace").strip().splitlines():
            return lines[-1]
    return f"the check exited {result.exit_code}"


def check_histories(store: Store, report: VerifyReport) -> None:
    """`image-builder verify`'s history part: each instance whose workdir repository breaks the
    rule, in report.history (one line each), over a report of store.verify, whose missing and
    corrupt files are passed over (already reported, and not mountable as they should be)."""
    from image_builder.runtime.mounts import RunnerError

    damaged = set(report.missing) | set(report.corrupt)
    index = store.index
    for iid, inst in sorted(index.instances.items()):
        if damaged & {*index.environments[inst.environment].files, inst.sqfs}:
            continue
        try:
            problem = check_instance(store.resolve(iid))
        except RunnerError as e:
            problem = f"cannot run the check: {e}"
        if problem:
            report.history.append(f"{shown_id(iid)}: {problem}")
