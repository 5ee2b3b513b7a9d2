"""The layering the project promises (docs/ARCHITECTURE.md), checked on the source itself.

Layers, imports pointing down only:

    dsbd_core.algorithm   pure torch: config, distributions, verify, width, engine, loop, scorers
    dsbd_core.models      transformers models behind the scorer protocol
    tools                 dsbd.bench.decode, dsbd.theory, dsbd.distill,     deployments (Ray Serve)
                          dsbd.acceptance, dsbd.prompts
    dsbd                  the CLI: every `dsbd` subcommand, the served benchmarks

Inside `dsbd_core.algorithm` and `deployments` the groups have floors of their own (GROUPS; the
packages' docstrings draw them): a module imports its own group, or groups on lower floors.

Every import in every module counts, also the ones inside functions (a lazy import is still a
dependency), so a cycle cannot hide behind one. The size rules keep files and functions small
enough to read: no source file over 500 lines, no function over 60 statements. And the tests
share helpers through tests/support/ (fixtures through a conftest.py), never by importing a test
module.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dsbd_core", "deployments", "dsbd")
TOOLS = ("dsbd.bench.decode", "dsbd.theory", "dsbd.distill", "dsbd.acceptance", "dsbd.prompts")
# (layer, its packages, rank): a module may import project modules of its own rank or lower,
# never higher, and never a sibling layer of the same rank (tools and deployments know nothing
# of each other). The first layer whose package holds a module is its layer.
LAYERS = [
    ("dsbd_core.algorithm", ("dsbd_core.algorithm",), 0),
    ("dsbd_core.models", ("dsbd_core.models",), 1),
    ("tools", TOOLS, 2),
    ("deployments", ("deployments",), 2),
    ("dsbd", ("dsbd",), 3),
    ("dsbd_core", ("dsbd_core",), 0),  # the package itself: a facade over the algorithm
]
# Third-party packages a layer must not import (what makes it usable on its own).
FORBIDDEN = {
    "dsbd_core.algorithm": ("transformers", "ray", "accelerate", "gguf"),
    "dsbd_core": ("transformers", "ray"),
    "dsbd_core.models": ("ray",),
    "tools": ("ray",),
}
# Floors inside a layer: (group, the modules it holds, floor). A module of a group may import
# its own group and groups on lower floors, never a higher one nor another group of its floor.
GROUPS: dict[str, list[tuple[str, tuple[str, ...], int]]] = {
    "dsbd_core.algorithm": [
        ("door: config, scorer, lazy_names", ("config", "scorer", "lazy_names"), 0),
        ("draws", ("draws",), 0),
        ("door: methods", ("methods",), 1),
        ("sequences", ("sequences",), 1),
        ("scorers", ("scorers",), 1),
        ("policy", ("policy",), 2),
        ("iteration", ("iteration",), 2),
        ("door: engine", ("engine",), 3),
        ("search", ("search",), 4),
        ("door: reference", ("reference",), 4),
        ("drivers", ("drivers",), 5),
        ("the package", ("",), 6),
    ],
    "deployments": [
        (
            "foundation",
            ("messages", "faults", "observability", "gcs_ft", "local_ray", "autoscaling"),
            0,
        ),
        ("replicas", ("replicas",), 1),
        ("decode", ("decode",), 2),
        ("api", ("api",), 3),
        ("batch_job", ("batch_job",), 4),
        (
            "the application",
            ("app", "definitions", "deployment_options", "llm_serving", "local_serve", ""),
            4,
        ),
    ],
}
MAX_LINES = 500
MAX_STATEMENTS = 60
# A silenced type error says which one and why (mypy, .ci/run): `# type: ignore[code]  # reason`.
TYPE_IGNORE = re.compile(r"# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # \S")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _layer(module: str) -> tuple[str, int]:
    for name, packages, rank in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in packages):
            return name, rank
    raise AssertionError(f"{module} belongs to no layer")


def _imported_names(path: Path, package: str) -> set[str]:
    """Every dotted name `path` imports anywhere: `a.b` for `import a.b`, `a` and `a.x` for
    `from a import x`, a relative import resolved against `package`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.update([f"{base}.{alias.name}" for alias in node.names] + [base])
    return names


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules and top-level third-party packages `module` imports anywhere."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for name in _imported_names(path, package):
        while name and name not in known and "." in name:
            name = name.rpartition(".")[0]
        found.add(name if name in known else name.split(".")[0])
    found.discard(module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def test_imports_point_down(graph: dict[str, set[str]]) -> None:
    wrong = []
    for module, imported in graph.items():
        layer, rank = _layer(module)
        for other in imported:
            if other in graph:
                other_layer, other_rank = _layer(other)
                sideways = other_rank == rank and other_layer != layer and layer != "dsbd_core"
                if other_rank > rank or sideways:
                    wrong.append(f"{module} ({layer}) imports {other} ({other_layer})")
            elif other in FORBIDDEN.get(layer, ()):
                wrong.append(f"{module} ({layer}) imports {other}")
    assert not wrong, "\n".join(sorted(wrong))


def _group(package: str, module: str) -> tuple[str, int]:
    rest = module[len(package) + 1 :] if module != package else ""
    for name, members, floor in GROUPS[package]:
        for member in members:
            if rest == member or (member and rest.startswith(member + ".")):
                return name, floor
    raise AssertionError(f"{module} belongs to no group of {package}")


@pytest.mark.parametrize("package", sorted(GROUPS))
def test_groups_inside_a_layer_point_down(graph: dict[str, set[str]], package: str) -> None:
    """No upward or sideways import between the groups of `dsbd_core.algorithm` (the door, draws,
    sequences, scorers, policy, iteration, search, drivers) or of `deployments` (foundation,
    replicas, decode, api, batch_job, the application)."""
    inside = [m for m in graph if m == package or m.startswith(package + ".")]
    wrong = []
    for module in inside:
        group, floor = _group(package, module)
        for other in graph[module]:
            if other not in inside:
                continue
            other_group, other_floor = _group(package, other)
            if other_floor > floor or (other_floor == floor and other_group != group):
                wrong.append(f"{module} ({group}) imports {other} ({other_group})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components over project modules: every one a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
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
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # Packages import their own modules (re-exports) and modules import their package's
    # facade; a package with its own children is not a cycle of concerns.
    real = [c for c in cycles if not _package_with_children(c)]
    assert not real, f"import cycles: {real}"


def _package_with_children(component: list[str]) -> bool:
    shortest = min(component, key=len)
    return all(m == shortest or m.startswith(shortest + ".") for m in component)


def _tracked_python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / name for name in listed if (REPO / name).is_file()]


def _statements(function: ast.AST) -> int:
    """Statements in a function's body, nested blocks included, nested definitions as one."""
    count, stack = 0, list(getattr(function, "body", []))
    while stack:
        statement = stack.pop()
        count += 1
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for name in ("body", "orelse", "finalbody"):
            stack.extend(s for s in getattr(statement, name, []) or [] if isinstance(s, ast.stmt))
        for handler in getattr(statement, "handlers", []) or []:
            stack.extend(handler.body)
        for case in getattr(statement, "cases", []) or []:
            stack.extend(case.body)
    return count


@pytest.mark.slow
def test_files_and_functions_are_small() -> None:
    long_files, long_functions = [], []
    for path in _tracked_python_files():
        text = path.read_text()
        name = path.relative_to(REPO)
        if text.count("\n") > MAX_LINES:
            long_files.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := _statements(node)) > MAX_STATEMENTS:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {n} statements")
    assert not long_files, "\n".join(long_files)
    assert not long_functions, "\n".join(long_functions)


def test_type_ignores_name_their_error_and_reason() -> None:
    bare = []
    for path in _modules().values():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for token in tokens:
            if token.type == tokenize.COMMENT and "type: ignore" in token.string:
                if not TYPE_IGNORE.match(token.string):
                    bare.append(f"{path.relative_to(REPO)}:{token.start[0]}: {token.string}")
    assert not bare, "a type: ignore without [code]  # reason:\n" + "\n".join(bare)


@pytest.mark.slow
def test_the_algorithm_imports_nothing_heavy() -> None:
    """Importing the algorithm (and the dsbd_core facade) loads neither transformers nor Ray."""
    code = (
        "import sys, dsbd_core, dsbd_core.algorithm.drivers.loop, "
        "dsbd_core.algorithm.drivers.lockstep; "
        "bad = [m for m in ('transformers', 'ray', 'deployments', 'dsbd') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


# The CLI's whole parser (every command's flags and their defaults) and `dsbd ray-env`, whose
# printed HOME (kept for `serve run`) is removed.
_PARSE = """
with contextlib.redirect_stdout(io.StringIO()) as printed:
    dsbd.cli.build_parser().parse_args(["distill", "--out", "x"])
    dsbd.cli.main(["ray-env"])
shutil.rmtree(dict(x.split("=", 1) for x in printed.getvalue().split())["HOME"])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "then", "absent"),
    [
        ("dsbd.cli", "", ("torch", "transformers", "ray")),
        ("dsbd.cli", _PARSE, ("torch", "transformers", "ray")),
        ("deployments.decode.session_registry", "", ("torch", "transformers")),
        ("deployments.app", "", ("torch", "transformers")),
        ("deployments.llm_serving", "", ("torch", "transformers")),
    ],
)
def test_entry_points_import_only_what_they_use(
    module: str, then: str, absent: tuple[str, ...]
) -> None:
    """The CLI parses (`dsbd --help`, flag errors, `dsbd ray-env`) without torch, transformers
    or Ray, Serve's SessionRegistry replica starts without torch, and an application is built
    (`dsbd serve`'s config check, Serve's build task, `serve run`) without the replicas' code
    (deployments/definitions.py): what a process imports is most of the CPU it spends starting
    (a server starts a dozen replicas at once)."""
    found = f"print(','.join(m for m in {absent!r} if m in sys.modules))"
    code = f"import contextlib, io, shutil, sys, {module}\n{then}\n{found}"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"


def test_every_layer_is_a_known_package(graph: dict[str, set[str]]) -> None:
    by_layer: dict[str, int] = defaultdict(int)
    for module in graph:
        by_layer[_layer(module)[0]] += 1
    assert set(by_layer) == {name for name, _, _ in LAYERS}


def _test_module_imports(path: Path) -> list[str]:
    """The `tests.<...>.test_*` modules that `path` imports anywhere (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).parent.parts)
    found = set()
    for name in _imported_names(path, package):
        parts = name.split(".")
        if parts[0] == "tests":
            tested = [i for i, part in enumerate(parts) if i and part.startswith("test_")]
            if tested:
                found.add(".".join(parts[: tested[0] + 1]))  # the module, not a name in it
    return sorted(found)


def test_no_test_module_imports_another() -> None:
    """A test module is an entry point, not a library: what two of them share lives in
    tests/support/ (a shared fixture in a conftest.py), so a test module, a support module or a
    conftest.py imports no `tests.<...>.test_*` module."""
    paths = sorted((REPO / "tests").rglob("*.py"))
    assert any(path.name == "test_layers.py" for path in paths)
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in paths
        for name in _test_module_imports(path)
    ]
    assert not wrong, "\n".join(wrong)
