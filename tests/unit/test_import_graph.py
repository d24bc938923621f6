"""hostd/'s import graph has no circle (STYLE: hand the variant in; never
look it up from inside).

The graph is read from the source with `ast`: one node per file, one edge
per `import hostd.X` / `from hostd.X import Y` anywhere in a file, at the
top or inside a function (a deferred import still makes the importer depend
on the imported). `from hostd.X import Y` names the module X.Y when that is
a file, else the package X. Importing a module of a package from outside it
also runs the package's __init__.py first, so that import depends on the
package too (issue 49: hostd.accounts imported hostd.config.schema, whose
package's __init__ imported host_check, which imported hostd.accounts: a
circle that counting only the files hid). A package's own __init__.py is not
counted as a dependency of its own modules: re-exporting one's own modules
is how a package is built, not a circle. An import under `if TYPE_CHECKING:`
never runs: a type checker reads it, the interpreter does not, so it is no
edge (the strategies name reload.Reload in their annotations that way).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hostd

ROOT = Path(hostd.__file__).resolve().parent


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def outer_packages(target: str, importer: str, files) -> list[str]:
    """The packages whose __init__ importing TARGET runs and IMPORTER is not inside."""
    found = []
    package = target.rpartition(".")[0]
    while "." in package:
        if package in files and not (importer == package or importer.startswith(package + ".")):
            found.append(package)
        package = package.rpartition(".")[0]
    return found


def runtime_nodes(tree: ast.AST):
    """Every node of TREE but those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                while target and target not in files:  # import hostd.a.b.c -> the deepest file
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                    graph[name].update(outer_packages(target, name, files))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_of_hostd_has_no_circle():
    graph = import_graph()
    assert graph["hostd.backends"] and graph["hostd.main"], "the graph reader found no edges"
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_circle_through_a_packages_init_is_found(tmp_path):
    """hostd/a.py imports hostd/p/x.py, whose package's __init__ imports
    hostd/p/y.py, which imports hostd/a.py: no file imports a file that
    imports it back, yet importing hostd.a runs that loop."""
    root = tmp_path / "hostd"
    (root / "p").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("def f():\n    from hostd.p import x\n")
    (root / "p/__init__.py").write_text("from hostd.p.y import g\n")
    (root / "p/x.py").write_text("")
    (root / "p/y.py").write_text("from hostd import a\n")
    assert circles(import_graph(root)) == [["hostd.a", "hostd.p", "hostd.p.y"]]


def test_an_import_only_a_type_checker_reads_is_no_edge(tmp_path):
    root = tmp_path / "hostd"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hostd import b\n")
    (root / "b.py").write_text("from hostd import a\n")
    assert import_graph(root)["hostd.a"] == set() and circles(import_graph(root)) == []
    (root / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    from hostd import b\n")
    assert circles(import_graph(root)) == [["hostd.a", "hostd.b"]]
