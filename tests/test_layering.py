"""The import picture, read from the source with `ast` (every import: top-level, inside
functions, type-only): dependencies run server -> scheduler -> model and never back; no
module in model/ is a process entry point or imports one; no package has an import
circle; a weight format (model/quant/) never imports the kernel plan (model/plan/) that
chooses its kernels. And the size a reader can take in: no file over 300 lines, no
function over 80."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "scheduler", "server")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
}


def imports(name: str) -> set[str]:
    """The project modules `name` imports; `from package import module` counts the module."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: imports(name) for name in MODULES}


def layer(name: str) -> str:
    return name.split(".")[0]


def test_the_graph_is_read() -> None:
    assert "server.startup.launch" in GRAPH["server.startup.cli"]
    assert "model.loader" in GRAPH["scheduler.runner.rank_process"]


def test_dependencies_run_one_way() -> None:
    allowed = {"model": {"model"}, "scheduler": {"scheduler", "model"}, "server": set(PACKAGES)}
    wrong = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if layer(target) not in allowed[layer(name)]
    ]
    assert not wrong


def test_no_process_entry_point_in_model() -> None:
    entry_points = {name for name, path in MODULES.items() if "__name__ == " in path.read_text()}
    assert "scheduler.runner.rank_process" in entry_points
    model = {name for name in MODULES if layer(name) == "model"}
    assert not model & entry_points
    assert not [f"{name} -> {t}" for name in model for t in GRAPH[name] if t in entry_points]


MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 80


def circle(package: str) -> list[str] | None:
    """One import circle among `package`'s modules, as the path round it, or None."""
    members = {name for name in MODULES if layer(name) == package}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for target in sorted(GRAPH[name] & members):
            found = visit(target, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    return next(filter(None, (visit(name, []) for name in sorted(members))), None)


def test_a_circle_is_found() -> None:
    saved = set(GRAPH["model.errors"])
    GRAPH["model.errors"].add("model.plan.kernel_plan")  # which imports model.errors
    try:
        assert circle("model") is not None
    finally:
        GRAPH["model.errors"] = saved


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    found = circle(package)
    assert found is None, " -> ".join(found)


def test_weight_formats_never_import_the_kernel_plan() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name.startswith("model.quant")
        for target in targets
        if target.startswith("model.plan")
    ]
    assert not wrong


@pytest.mark.parametrize("package", PACKAGES)
def test_no_file_over_300_lines(package: str) -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for name, path in MODULES.items()
        if layer(name) == package and (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_80_lines(package: str) -> None:
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
        for name, path in MODULES.items()
        if layer(name) == package
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long


def test_the_scheduler_package_face_is_for_outside_callers() -> None:
    """scheduler/__init__.py imports the modules behind it; a module inside importing it
    back would close a circle through every one of them."""
    inside = [name for name in GRAPH if layer(name) == "scheduler" and "scheduler" in GRAPH[name]]
    assert not inside


def test_server_imports_the_scheduler_only_through_its_face() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if layer(name) == "server"
        for target in targets
        if layer(target) == "scheduler" and target != "scheduler"
    ]
    assert not wrong
