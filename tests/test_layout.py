"""The package's house rules (issue 37), read from its own files: folders by layer, no import from a lower layer up to
a higher one (at module level or inside a function) and no string naming a module up there either, no circle of
imports, a docstring on every folder, every module named on docs/layout.md, and no import hook of ours in the
processes that load the plugin."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

import pytest_llmload
from pytest_llmload.plugin.check_registry import ENTRY_POINT_GROUP

PACKAGE = Path(pytest_llmload.__file__).parent
REPO = PACKAGE.parent
LAYOUT_PAGE = REPO / "docs" / "layout.md"

# Lowest first: a module imports from its own layer or a lower one. The package's top (its __init__, __main__)
# and the shipped suite stand above every layer.
LAYERS = ("config", "system", "instruments", "runners", "loader", "fixes", "placement", "checks", "failures",
          "prediction", "reports", "plugin", "main_job", "commands")
TOP = len(LAYERS)


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


# Parsed on first use, not at collection: every pytest run imports this file, most (`-m gpu`, `-k`) run none of it.
@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), str(MODULES[module]))


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports anywhere in its code (``from a import b`` where ``a.b`` is a module
    counts as an import of ``a.b``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "pytest_llmload")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != "pytest_llmload":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {module: _imports(module) for module in MODULES}


def test_no_module_imports_a_higher_layer():
    upward = [f"{module} ({LAYERS[_layer(module)] if _layer(module) < TOP else 'top'}) imports {imported} "
              f"({LAYERS[_layer(imported)] if _layer(imported) < TOP else 'top'})"
              for module, imported_set in sorted(_graph().items()) for imported in sorted(imported_set)
              if _layer(imported) > _layer(module)]
    assert not upward, "\n".join(upward)


# A dotted path of the package in a string: a module path, or a spec's module before its ':'.
_DOTTED = re.compile(r"\bpytest_llmload(?:\.\w+)+")


def _named_module(dotted: str) -> str:
    """The package's module a dotted path names: its longest prefix that is a module (``a.b.attr`` -> ``a.b``)."""
    parts = dotted.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in MODULES)


def _strings_in_code(module: str) -> list[ast.Constant]:
    """The string constants of a module's code (an f-string's literal parts included), not its docstrings: a
    docstring may point its reader anywhere, as a comment may."""
    nodes = list(ast.walk(_tree(module)))
    docstrings = {id(node.body[0].value) for node in nodes
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and "pytest_llmload." in node.value and id(node) not in docstrings]


def test_no_string_in_the_code_names_a_module_of_a_higher_layer():
    # A loader spec or a module path in a string is an import made later (issue 47): the same rule holds. The
    # package's top (`pytest_llmload.Check`, `python -m pytest_llmload.suite`) is its public face, which a help text
    # may name from any layer; a higher layer's module it may not.
    upward = [f"{module}:{node.lineno} names {dotted} ({LAYERS[_layer(_named_module(dotted))]})"
              for module in sorted(MODULES) for node in _strings_in_code(module)
              for dotted in _DOTTED.findall(node.value) if dotted != ENTRY_POINT_GROUP  # a group's name, public
              and _layer(module) < _layer(_named_module(dotted)) < TOP]
    assert not upward, "\n".join(upward)


def test_no_circle_of_imports():
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in _graph()[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in _graph():
        if module not in index:
            visit(module)
    assert not circles, circles


def test_every_layer_is_a_folder_whose_init_says_what_it_holds():
    for layer in LAYERS:
        init = PACKAGE / layer / "__init__.py"
        assert init.is_file(), f"no folder {layer}/"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{layer}/__init__.py has no docstring saying what the layer holds"
    loose = sorted(path.name for path in PACKAGE.glob("*.py")
                   if path.name not in {"__init__.py", "__main__.py"})
    assert not loose, f"modules outside the layers' folders: {loose}"


# The known failures' modules are named by their pattern, so that adding one edits no page (issue 47).
FAILURE_MODULES = "`failures/<id>.py`"


def test_the_layout_page_names_every_module_and_the_layers_in_order():
    page = LAYOUT_PAGE.read_text()
    assert FAILURE_MODULES in page
    unnamed = [str(path.relative_to(PACKAGE)) for module, path in MODULES.items()
               if path.name != "__init__.py" and path.parent.name != "failures"
               and str(path.relative_to(PACKAGE)) not in page]
    assert not unnamed, f"docs/layout.md does not name: {unnamed}"
    order = re.search(r"^Layers, lowest first: (.*)$", page, re.M)
    assert order, "docs/layout.md has no 'Layers, lowest first:' line"
    assert re.findall(r"`(\w+)/`", order.group(1)) == list(LAYERS)


def test_no_import_hook_of_ours_is_on_sys_meta_path():
    # This process imported pytest_llmload and loaded the plugin (its entry point): every pytest process of every repo
    # that installs it does the same, so a finder of ours would sit in front of all their imports. No release had
    # the paths one served (issue 47).
    assert importlib.import_module("pytest_llmload.plugin")
    ours = [finder for finder in sys.meta_path if type(finder).__module__.startswith("pytest_llmload")]
    assert not ours, ours
    assert importlib.util.find_spec("pytest_llmload.loading") is None  # a path from before the folders


@pytest.mark.parametrize("name", sorted(pytest_llmload.__all__))
def test_a_public_name_of_the_package_resolves(name):
    assert getattr(pytest_llmload, name) is not None


def test_the_entry_point_module_carries_the_hooks_and_fixtures():
    plugin = importlib.import_module("pytest_llmload.plugin")
    assert callable(plugin.pytest_configure) and callable(plugin.llmload_loader)
