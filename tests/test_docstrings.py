"""Each public name's docstring says its arguments, returns and raises, in one style (Google's, as torch writes
them), so that ``help(tensorplay_p2p.isend)`` says what docs/api.md says; under the compiled engine too, whose C
functions show the Python reference's docstring."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)

SECTIONS = ("Args:", "Returns:", "Raises:")
API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PACKAGE = Path(__file__).resolve().parents[1] / "tensorplay_p2p"


def _parameters(function: Callable[..., Any]) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    names = []
    for p in signature.parameters.values():
        if p.name in ("self", "cls"):
            continue
        names.append(("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name)
    return names


def _section(doc: str, title: str) -> str | None:
    """The text of section ``title`` (up to the next section or the end), None if absent."""
    others = "|".join(map(re.escape, SECTIONS))
    match = re.search(rf"^\s*{re.escape(title)}\s*$(.*?)(?=^\s*(?:{others})\s*$|\Z)", doc, re.M | re.S)
    return None if match is None else match.group(1)


def _problems(name: str, function: Callable[..., Any], *, method: bool = False) -> list[str]:
    doc = inspect.getdoc(function) or ""
    if not doc.strip():
        return [f"{name}: no docstring"]
    found = []
    parameters = _parameters(function)
    args = _section(doc, "Args:")
    if parameters:
        if args is None:
            found.append(f"{name}: no Args: section (it takes {parameters})")
        else:
            listed = set(re.findall(r"^\s{2,}(\*{0,2}\w+)(?: \(.*?\))?:", args, re.M))
            missing = [p for p in parameters if p not in listed]
            if missing:
                found.append(f"{name}: Args: does not describe {missing}")
    if not method:
        if _section(doc, "Returns:") is None:
            found.append(f"{name}: no Returns: section")
        if parameters and _section(doc, "Raises:") is None:
            found.append(f"{name}: no Raises: section")
    return found


def _public_methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    """The methods of a class of the package that docs/api.md names (``wait``, ``exchange``, ...); the plain-named
    ones the package's modules use among themselves are internal (docs/architecture.md, "Names")."""
    documented = API.read_text(encoding="utf-8")
    methods: list[tuple[str, Callable[..., Any]]] = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("tensorplay_p2p"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or inspect.isclass(value) or not callable(value) or attr in dict(methods):
                continue
            if re.search(rf"`(?:\w+\.)?{attr}\(", documented):
                methods.append((attr, getattr(cls, attr)))
    return methods


def test_every_public_function_says_its_arguments_returns_and_raises() -> None:
    problems = []
    for name in dist.__all__:
        obj = getattr(dist, name)
        if inspect.isclass(obj) or not callable(obj):
            continue
        problems += _problems(name, obj)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "module",
    ["tensorplay_p2p.run", "tensorplay_p2p.bench", "tensorplay_p2p.bench.frameworks", "tensorplay_p2p.autograd"],
)
def test_the_public_modules_functions_say_theirs_too(module: str) -> None:
    if module == "tensorplay_p2p.autograd":
        pytest.importorskip("torch")
    imported = importlib.import_module(module)
    problems = []
    for name in imported.__all__:
        obj = getattr(imported, name)
        if inspect.isclass(obj):
            problems += [] if (inspect.getdoc(obj) or "").strip() else [f"{module}.{name}: no docstring"]
        elif callable(obj):
            problems += _problems(f"{module}.{name}", obj)
    assert not problems, "\n".join(problems)


def test_the_integrations_public_functions_say_theirs_too() -> None:
    """Read from the source: importing ``tensorplay_p2p.tensorplay`` installs it into TensorPlay."""
    source = ast.parse((PACKAGE / "tensorplay" / "_hook.py").read_text(encoding="utf-8"))
    functions = {n.name: n for n in source.body if isinstance(n, ast.FunctionDef)}
    for name in ("install", "installed"):
        doc = ast.get_docstring(functions[name]) or ""
        assert _section(doc, "Returns:") is not None, name
    assert _section(ast.get_docstring(functions["install"]) or "", "Raises:") is not None


def test_every_public_class_says_its_arguments_and_its_methods_theirs() -> None:
    problems = []
    for name in dist.__all__:
        cls = getattr(dist, name)
        if not inspect.isclass(cls):
            continue
        if not (inspect.getdoc(cls) or "").strip():
            problems.append(f"{name}: no docstring")
        if issubclass(cls, BaseException):
            continue
        for attr, method in _public_methods(cls):
            problems += _problems(f"{name}.{attr}", method, method=True)
    assert not problems, "\n".join(problems)


def test_the_compiled_calls_show_the_python_reference_s_docstring() -> None:
    from tensorplay_p2p._src import engine
    from tensorplay_p2p._src.collectives import api
    from tensorplay_p2p._src.p2p import ops, work

    if engine.accel is None:
        pytest.skip("the pure-Python engine: the calls are the Python functions")
    for name, python in [*ops.reference.items(), *api.reference.items()]:
        compiled = getattr(dist, name)
        assert compiled is not python
        assert inspect.getdoc(compiled) == inspect.getdoc(python), name
        shape = [(p.name, p.kind, p.default) for p in inspect.signature(python).parameters.values()]
        assert [(p.name, p.kind, p.default) for p in inspect.signature(compiled).parameters.values()] == shape, name
    for name, python in work.reference.items():
        cls, _, method = name.partition(".")
        compiled = getattr(getattr(dist, cls), method)
        assert compiled is not python and inspect.getdoc(compiled) == inspect.getdoc(python), name
