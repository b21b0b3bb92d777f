"""The import graph of ``qsdp_jax/`` and ``experiments/``, read from the source with ``ast``.

Every import counts: module level, function-local, ``from pkg import module``, relative. The
graph has no cycle; ``qsdp_jax`` imports nothing of ``experiments``; the experiment rooms import
one way (``experiments/__init__.py``): gpt <- shelf <- bench and convergence, bench and
convergence independent of each other. A function-local import of another experiments module
says why on its line or the line above (most are "after the device flags": they import jax).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("qsdp_jax", "experiments")

#: The rooms each room may import (its own included); "" is the top of experiments/.
MAY_IMPORT = {
    "": {"", "gpt"},
    "gpt": {"gpt"},
    "shelf": {"gpt", "shelf"},
    "bench": {"gpt", "shelf", "bench"},
    "convergence": {"gpt", "shelf", "convergence"},
}


def module_files(root: Path = REPO) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` under the packages (``__init__`` is the
    package itself)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The longest known module that ``name`` is or lies in (None outside the packages)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules) -> list[tuple[str, int, bool]]:
    """``(imported module, line, function-local)`` for every import in ``path`` that names a
    module of the packages."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module, up level - 1
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            for a in node.names:  # a submodule if there is one of that name, else origin
                targets.append(f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin)
        for hit in dict.fromkeys(_resolve(t, modules) for t in targets):  # once per module
            if hit is not None and hit != module:
                found.append((hit, node.lineno, id(node) not in top))
    return found


def import_graph(root: Path = REPO) -> dict[str, dict[str, list[int]]]:
    """``{module: {imported module: [lines]}}``."""
    modules = module_files(root)
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in modules}
    for m, path in modules.items():
        for target, line, _ in imports_of(m, path, modules):
            graph[m].setdefault(target, []).append(line)
    return graph


def strongly_connected(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def enter(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        return v, iter(sorted(graph[v]))

    for root in sorted(graph):
        if root in index:
            continue
        work = [enter(root)]
        while work:
            node, succ = work[-1]
            for w in succ:
                if w not in index:
                    work.append(enter(w))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while not comp or comp[-1] != node:
                        comp.append(stack.pop())
                        on.discard(comp[-1])
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return sorted(comps)


def shortest_cycle(graph, start: str) -> list[str] | None:
    """``[start, ..., start]``, the shortest cycle through ``start`` (breadth first), or None."""
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def find_cycles(graph) -> list[list[str]]:
    """The shortest cycle through each module that is on one, each cycle once."""
    cycles, seen = [], set()
    for comp in strongly_connected(graph):
        for m in comp:
            c = shortest_cycle(graph, m)
            if frozenset(c) not in seen:
                seen.add(frozenset(c))
                cycles.append(c)
    return cycles


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "experiments":
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else ""


def wrong_way(graph) -> list[str]:
    """Imports against the direction: qsdp_jax -> experiments, and room -> a room it may not import."""
    bad = []
    for m, targets in sorted(graph.items()):
        for t, lines in sorted(targets.items()):
            if m.split(".")[0] == "qsdp_jax" and t.split(".")[0] == "experiments":
                bad.append(f"{m} (line {lines[0]}) imports {t}: the library imports no experiment")
            src, dst = _room(m), _room(t)
            if src is not None and dst is not None and dst not in MAY_IMPORT[src]:
                bad.append(
                    f"{m} (line {lines[0]}) imports {t}: room {src or 'experiments'} may import "
                    f"only {sorted(r or 'experiments' for r in MAY_IMPORT[src])}"
                )
    return bad


def unexplained_local_imports(root: Path = REPO) -> list[str]:
    """Function-local imports of an experiments module with no comment on their line or the
    line above."""
    modules = module_files(root)
    bad = []
    for m, path in modules.items():
        lines = path.read_text().splitlines()
        for target, line, local in imports_of(m, path, modules):
            if not local or not target.startswith("experiments"):
                continue
            here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                bad.append(f"{path.relative_to(root)}:{line}: {here.strip()}")
    return bad


def test_the_graph_reads_every_kind_of_import(tmp_path):
    """Function-local, ``from pkg import module`` and relative imports are all edges."""
    pkg = tmp_path / "experiments"
    (pkg / "gpt").mkdir(parents=True)
    (tmp_path / "qsdp_jax").mkdir()
    (tmp_path / "qsdp_jax" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "gpt" / "__init__.py").write_text("")
    (pkg / "gpt" / "a.py").write_text("def f():\n    from experiments.gpt import b\n")
    (pkg / "gpt" / "b.py").write_text("from . import c\n")
    (pkg / "gpt" / "c.py").write_text("from .a import f\n")
    graph = import_graph(tmp_path)
    assert graph["experiments.gpt.a"] == {"experiments.gpt.b": [2]}
    assert graph["experiments.gpt.b"] == {"experiments.gpt.c": [1]}
    assert graph["experiments.gpt.c"] == {"experiments.gpt.a": [1]}
    assert find_cycles(graph) == [["experiments.gpt.a", "experiments.gpt.b", "experiments.gpt.c", "experiments.gpt.a"]]
    assert unexplained_local_imports(tmp_path) == ["experiments/gpt/a.py:2: from experiments.gpt import b"]


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_one_way():
    bad = wrong_way(import_graph())
    assert not bad, "\n".join(bad)


def test_function_local_imports_say_why():
    bad = unexplained_local_imports()
    assert not bad, "function-local imports of experiments modules without a comment:\n" + "\n".join(bad)


def test_the_cli_modules_import_no_jax():
    """The trainer CLI sets the device flags before jax starts: its modules import no jax."""
    mods = (
        "experiments.train_gpt",
        "experiments.gpt.train",
        "experiments.gpt.args",
        "experiments.gpt.cluster_args",
        "experiments.gpt.setup",
        "experiments.gpt.report",
        "experiments.gpt.run_files",
        "experiments.gpt.data",
        "experiments.gpt.demo",
        "experiments.shelf.multiproc",
        "experiments.bench.comm",
        "experiments.convergence.run",
    )
    code = f"import sys\nfor m in {mods!r}:\n    __import__(m)\n    assert 'jax' not in sys.modules, m\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_old_commands_still_run():
    """``python -m experiments.train_gpt`` (the alias) and ``python -m experiments.convergence``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for module in ("experiments.train_gpt", "experiments.convergence"):
        r = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and "usage:" in r.stdout, (module, r.stderr[-2000:])
