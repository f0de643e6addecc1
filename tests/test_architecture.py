"""docs/architecture.md stays true: its module graph is the package's, and the graph has no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tensorplay_p2p"


def _module(name: str) -> bool:
    """Whether ``name`` (``ops``, ``torch.backend``) is a module of the package."""
    return (PACKAGE / f"{name.replace('.', '/')}.py").exists()


def _load_time_imports(path: Path, within: str = "") -> set[str]:
    """The package modules ``path`` imports at load time (not under TYPE_CHECKING, not inside functions); ``within``
    is its subpackage (``torch.``) or empty, and a subpackage's modules are named as ``torch.backend``."""
    found: set[str] = set()
    bases = {1: within, 2: ""} if within else {1: ""}  # what a relative import's dots lead to

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.ImportFrom):
                absolute = child.level == 0 and child.module == "tensorplay_p2p"
                base = "" if absolute else bases.get(child.level)
                if base is not None:
                    if child.module and not absolute:
                        found.add(base + child.module.split(".")[0])
                    else:
                        found.update(base + a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {name for name in found if _module(name)}


def graph() -> dict[str, set[str]]:
    """Module → the package modules it imports at load time (a subpackage's modules too, as ``torch.backend``)."""
    generated = ("__main__", "buildinfo")  # buildinfo: the install's record of the accelerator's build
    modules = {p.stem: _load_time_imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem not in generated}
    for sub in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        for path in sorted(sub.glob("*.py")):
            name = sub.name if path.stem == "__init__" else f"{sub.name}.{path.stem}"
            modules[name] = _load_time_imports(path, f"{sub.name}.")
    return modules


def documented() -> dict[str, set[str]]:
    """The graph as docs/architecture.md draws it: ``module[, module] → imported, imported  (remark)``."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    drawn: dict[str, set[str]] = {}
    for line in block.splitlines():
        sources, _, targets = re.sub(r"\(.*?\)", "", line).partition("→")
        imported = {t.strip() for t in targets.split(",") if t.strip()}
        for name in sources.split(","):
            drawn[name.strip()] = imported
    return drawn


def test_the_module_graph_has_no_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            assert state.get(target) != 1, f"import cycle: {' → '.join([*path, module, target])}"
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module, [])


def test_docs_architecture_draws_the_real_module_graph() -> None:
    real = {module: targets for module, targets in graph().items()}
    drawn = documented()
    for module, targets in real.items():
        assert module in drawn, f"docs/architecture.md does not list module {module}"
        assert drawn[module] == targets, f"{module}: the docs say {sorted(drawn[module])}, the code {sorted(targets)}"
