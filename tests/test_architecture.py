"""docs/architecture.md stays true: its module graph is the package's (every folder walked), the graph has no cycle,
and no module of ``_src/`` imports a layer above its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tensorplay_p2p"

# The layers of ``_src/``, lowest first: a module imports (at load time) only its own layer and those below it.
LAYERS = (("errors", "settings"), ("engine",), ("memory",), ("process",), ("p2p",), ("persistent",), ("collectives",))
# Version 0.1's documented paths into what is now internal, kept as deprecated aliases (docs/api.md, CHANGELOG.md).
ALIASES = ("devices", "engine", "layouts", "torchbench")
GENERATED = ("buildinfo",)  # the install's record of the accelerator's build


def _dotted(path: Path) -> str:
    """``tensorplay_p2p/_src/p2p/ops.py`` → ``_src.p2p.ops``; a folder's ``__init__.py`` is the folder."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body) and len(body) <= 1


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name, but ``__main__``s, the generated ones, the aliases, and the
    ``__init__.py`` of a folder that holds only its docstring."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _dotted(path)
        last = name.rpartition(".")[2]
        if last in ("__main__", *GENERATED) or name in ALIASES:
            continue
        if path.name == "__init__.py" and _docstring_only(path):
            continue  # a folder's docstring only: the folder is its modules
        found[name] = path
    return found


def _folders() -> set[str]:
    """Every folder of the package, by dotted name: importing one (``from .. import collectives``) imports it."""
    return {_dotted(p) for p in PACKAGE.rglob("__init__.py")}


def _load_time_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules (or folders) ``path`` imports at load time: not only under ``if TYPE_CHECKING:``, not
    inside functions; ``from`` imports and plain ``import tensorplay_p2p....`` alike."""
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    folders = _folders()
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        key = dotted or "__init__"
        return key if key in modules or key in folders else None

    def add(*candidates: str) -> None:
        for candidate in candidates:
            hit = resolve(candidate)
            if hit is not None:
                if hit != name:
                    found.add(hit)
                return

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                for other in child.orelse:  # the else branch runs at load time
                    visit(ast.Module(body=[other], type_ignores=[]))
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    parts = alias.name.split(".")
                    if parts[0] == "tensorplay_p2p" and len(parts) > 1:
                        add(".".join(parts[1:]))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                elif child.module and child.module.split(".")[0] == "tensorplay_p2p":
                    base = []
                else:
                    continue
                module = child.module or ""
                if not child.level:
                    module = module.removeprefix("tensorplay_p2p").lstrip(".")
                target = ".".join([*base, *([module] if module else [])])
                for alias in child.names:
                    add(f"{target}.{alias.name}" if target else alias.name, target)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def shown(name: str) -> str:
    """How the docs write a module: without the ``_src.`` prefix."""
    return name.removeprefix("_src.")


def graph() -> dict[str, set[str]]:
    """Module → the package modules it imports at load time, every folder walked, named as the docs write them."""
    modules = _modules()
    return {shown(n): {shown(t) for t in _load_time_imports(p, n, modules)} for n, p in modules.items()}


def documented() -> dict[str, set[str]]:
    """The graph as docs/architecture.md draws it: ``module[, module] → imported, imported  (remark)``."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    drawn: dict[str, set[str]] = {}
    for line in block.splitlines():
        if "→" not in line:
            continue
        sources, _, targets = re.sub(r"\(.*?\)", "", line).partition("→")
        imported = {t.strip() for t in targets.split(",") if t.strip()}
        for name in sources.split(","):
            drawn[name.strip()] = imported
    return drawn


def _layer(name: str) -> int | None:
    """The layer of a module of ``_src/`` (as the docs write it), None for one outside ``_src/``."""
    if not (PACKAGE / "_src" / name.split(".")[0]).exists() and not (PACKAGE / "_src" / f"{name}.py").exists():
        return None
    top = name.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    return len(LAYERS)  # the command line sits above every layer


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


def test_no_internal_module_imports_a_layer_above_its_own() -> None:
    for module, targets in graph().items():
        mine = _layer(module)
        if mine is None:
            continue
        for target in targets:
            theirs = _layer(target)
            assert theirs is not None, f"{module} (internal) imports {target}, which is outside _src/"
            assert theirs <= mine, f"{module} (layer {mine}) imports {target} (layer {theirs}): an upward arrow"


def test_every_internal_module_is_in_a_layer() -> None:
    tops = {p.stem if p.suffix else p.name for p in (PACKAGE / "_src").iterdir() if p.name != "__pycache__"}
    tops -= {"__init__", "cli"}
    assert tops == {name for layer in LAYERS for name in layer}, tops


def test_docs_architecture_draws_the_real_module_graph() -> None:
    real = graph()
    drawn = documented()
    for module, targets in real.items():
        assert module in drawn, f"docs/architecture.md does not list module {module}"
        assert drawn[module] == targets, f"{module}: the docs say {sorted(drawn[module])}, the code {sorted(targets)}"
    assert not set(drawn) - set(real), f"docs/architecture.md lists modules that do not exist: {set(drawn) - set(real)}"


def test_the_aliases_are_the_only_top_level_modules_besides_the_public_ones() -> None:
    public = {"__init__", "__main__", "config", "run"}
    top = {p.stem for p in PACKAGE.glob("*.py")} - set(GENERATED)  # (an in-place build of an older tree)
    assert top == public | set(ALIASES), top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == {"_src", "autograd", "bench", "torch", "tensorplay"}, folders


def test_tests_readme_maps_every_unit_test_file() -> None:
    text = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    runners = ("jobs", "torchsuite", "tensorplaysuite", "torchprograms", "gpu")
    files = [p.relative_to(ROOT / "tests") for p in (ROOT / "tests").rglob("test_*.py")]
    unlisted = [str(f) for f in files if f.parts[0] not in runners and f"`{f.as_posix()}`" not in text]
    assert not unlisted, f"tests/README.md does not list {unlisted}"
