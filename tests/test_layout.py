"""The package layout is the pipeline: every module's imports (at module level and inside
functions) point down the stages or within its own, and no modules import each other
in a circle. Read from the source with ast, so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "image_builder"

# Lowest first; a module may import its own stage and the ones before it.
STAGES = [
    {"errors", "ownership", "progress", "tasks", ""},  # "" is image_builder/__init__.py (the version)
    {"oci"},
    {"pack"},
    {"store"},
    {"runtime"},
    {"build"},
    {"graders"},
    {"agents"},
    {"devtools", "cli", "cli_run", "cli_server", "cli_common", "cli_impossible", "cli_sandbox", "cli_slurm", "cli_swebench",
     "entry", "slurm", "rewards", "submit", "serve"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(STAGES) if top in names)


def imports_in(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that module `name` imports, relative imports resolved."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_in(path.read_text(), name, path.name == "__init__.py", set(paths))
            for name, path in paths.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_sub_package_says_what_it_owns_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, init


def test_no_module_imports_a_later_stage():
    upward = [f"{a} imports {b}" for a, targets in graph().items() for b in sorted(targets)
              if stage_of(b) > stage_of(a)]
    assert upward == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_check_sees_cycles_and_upward_imports():
    # The checks above are only worth something if they can fail.
    edges = graph()
    edges["image_builder.runtime.session"].add("image_builder.runtime.backends")
    assert any({"image_builder.runtime.backends", "image_builder.runtime.session"} <= set(c) for c in cycles(edges))
    # Imports inside functions count, relative ones are resolved, and a later stage is later.
    source = "def f():\n    from ..graders import grade\n    from . import sif\n"
    found = imports_in(source, "image_builder.pack.probe", False, set(edges))
    assert found == {"image_builder.graders.grade", "image_builder.pack.sif"}
    assert stage_of("image_builder.graders.grade") > stage_of("image_builder.pack.probe")


def test_documented_import_paths_still_work():
    import importlib.util
    import subprocess
    import sys

    from image_builder.graders import rewards
    from image_builder.runtime import InstanceLayers, RunRequest, open_session
    from image_builder.runtime.backends import open_session as defined
    from image_builder.store import Store
    from image_builder.store.store import Store as defined_store

    assert open_session is defined and Store is defined_store
    assert InstanceLayers.__module__ == "image_builder.runtime.session"
    assert RunRequest.__module__ == "image_builder.runtime.execution"
    # verl loads the reward function by its file path, outside any package.
    spec = importlib.util.spec_from_file_location("custom_module", PACKAGE / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score is rewards.compute_score
    # The holder starts under -S and must load nothing the runtime package does not need.
    loaded = subprocess.run([sys.executable, "-S", "-c", "import sys, image_builder.runtime; "
                             "print(sorted(m for m in sys.modules if m.startswith('image_builder')))"],
                            cwd=PACKAGE.parent, capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['image_builder', 'image_builder.runtime']"
