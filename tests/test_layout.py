"""The layout is the architecture (docs/design.md, "Rooms"): these checks keep it so.

The import graph is read from the sources with :mod:`ast` (function-level imports included, since they
are arrows all the same): no circles, no arrow from a lower room up, no module reaching into another
module's underscore names, ``sweep/`` free of torch, and no file much over 400 lines without a reason
stated at its top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "model", "sweep", "infra", "bench", "tests")

# The rank of each room: a module may import only modules of its own rank or lower. Longest prefix wins.
RANKS = {
    "kernels": 0,
    "model.config": 1, "model.counts": 1, "model.schedule": 1, "model.script.source": 1,
    "model.script.signing": 1,
    "model": 2,
    "sweep.redact": 3, "sweep.printable": 3, "sweep.compare.decision": 3,
    "sweep.store": 4,
    "sweep.neuron": 5,
    "sweep.spec": 6,
    "sweep.study": 7,
    "sweep.run": 8,
    "sweep.ship": 9, "sweep.dashboard": 9, "sweep.compare": 9,
    "sweep": 10,  # sweep/__init__.py, sweep/__main__.py, sweep/cli.py: the dispatcher
    "infra": 11,
    "bench": 12, "tests": 12,
}
# What sweep/ may know of model/: its torch-free knowledge, nothing that builds or trains.
SWEEP_MAY_IMPORT_FROM_MODEL = {"model.config", "model.counts", "model.schedule", "model.script.source",
                               "model.script.signing"}
MAX_LINES = 450  # "much over 400"
LONG_REASON = "Long file:"  # a module over MAX_LINES says why in its docstring, after these words


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            # templates: the programs export writes; studies: the worked example's script and kit, a team's files
            if any(part.startswith(".") or part in ("templates", "studies", "__pycache__")
                   for part in f.relative_to(ROOT).parts):
                continue
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


MODULES = _modules()


def _rank(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANKS:
            return RANKS[".".join(parts[:n])]
    raise AssertionError(f"{module} belongs to no room in RANKS")


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of ours in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_import_of_ours_names_a_module_that_exists():
    missing = [f"{m}:{line} imports {t}" for m in MODULES for t, _, line in _imports(m) if t not in MODULES]
    assert not missing, "\n".join(missing)


def test_the_import_graph_has_no_circles():
    graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def test_no_arrow_from_a_lower_room_up():
    up = [f"{m} (rank {_rank(m)}) imports {t} (rank {_rank(t)}) at line {line}"
          for m in MODULES for t, _, line in _imports(m) if t in MODULES and _rank(t) > _rank(m)]
    assert not up, "\n".join(up)


def test_no_module_imports_another_modules_underscore_names():
    private = [f"{m}:{line} imports {name} from {t}" for m in MODULES for t, name, line in _imports(m)
               if name and name.startswith("_") and not name.startswith("__") and t != m
               and not m.startswith("tests")]
    assert not private, "\n".join(private)


def test_sweep_knows_model_only_through_its_torch_free_knowledge():
    wrong = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("sweep")
             for t, _, line in _imports(m) if t.startswith("model") and t not in SWEEP_MAY_IMPORT_FROM_MODEL]
    torch = [f"{m} imports torch" for m in MODULES if m.startswith("sweep")
             for node in ast.walk(ast.parse(MODULES[m].read_text()))
             if isinstance(node, (ast.Import, ast.ImportFrom))
             and any((getattr(node, "module", None) or a.name).split(".")[0] == "torch" for a in node.names)]
    assert not wrong + torch, "\n".join(wrong + torch)


def test_importing_every_sweep_module_leaves_torch_unloaded():
    names = sorted(m for m in MODULES if m.startswith("sweep") and not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "a sweep module loads torch"


def test_a_long_file_says_why_at_its_top():
    silent = []
    for module in sorted(m for m in MODULES if not m.startswith("tests")):
        text = MODULES[module].read_text()
        lines = text.count("\n")
        if lines > MAX_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            silent.append(f"{MODULES[module].relative_to(ROOT)} has {lines} lines and no '{LONG_REASON}' reason")
    assert not silent, "\n".join(silent)
