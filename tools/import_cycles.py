"""Import cycles between the modules of a package, read from the source (nothing is imported).

``python -m tools.import_cycles [PACKAGE_DIR]`` (default: fp8_noncausal_attn) prints each cycle
as ``a -> b -> a`` and exits 1 when there is one. Every ``import`` statement counts, at module
level or inside a function (a deferred import only hides a cycle), except those under
``if TYPE_CHECKING:``. ``from X import name`` is an edge to ``X.name`` when that is a module of
the package, else to ``X``; the parent packages a dotted import runs first are not edges.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__.py)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Import nodes of a module, skipping ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [_from_target(prefix, alias.name, modules) for alias in node.names]
        found.update(t for t in targets if t in modules and t != name)
    return found


def _bound_names(path: Path) -> set[str]:
    """Names a module binds at its top level (assignments, definitions, imports)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _from_target(prefix: str, name: str, modules: dict[str, Path]) -> str:
    """The module ``from prefix import name`` depends on: the submodule ``prefix.name`` when
    the package has it; nothing ("") when ``prefix`` is a package that does not bind ``name``
    (a compiled extension module such as ``_C``); else ``prefix``."""
    if f"{prefix}.{name}" in modules:
        return f"{prefix}.{name}"
    path = modules.get(prefix)
    if path is not None and path.name == "__init__.py" and name not in _bound_names(path):
        return ""
    return prefix


def cycles(package_dir: Path) -> list[list[str]]:
    """One cycle through each group of modules that import each other (each strongly connected
    component of the import graph with more than one module)."""
    modules = module_names(package_dir)
    graph = {name: sorted(imports_of(name, path, modules)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return [_cycle_through(component, graph) for component in components]


def _cycle_through(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """One cycle from the first member back to it, inside the component."""
    inside = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = next(w for w in graph[path[-1]] if w in inside and (w == start or w not in seen))
        path.append(nxt)
        if nxt == start:
            return path
        seen.add(nxt)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    package_dir = Path(
        args[0] if args else Path(__file__).resolve().parents[1] / "fp8_noncausal_attn"
    )
    found = cycles(package_dir)
    for cycle in found:
        print(" -> ".join(cycle), f"(a cycle of {len(set(cycle))} modules)")
    print(f"{len(found)} import cycle(s) in {package_dir.name}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
