"""docs/ARCHITECTURE.md §2: what each module may import inside tokenmill.

The rule table is read from docs/ARCHITECTURE.md itself (its §2 table: the
module column and the "may import" column, every `name` in backticks), so the
document and the test cannot drift apart. Every module under tokenmill/ is
parsed (never imported) and each of its `tokenmill.*` imports is checked
against that table: absolute and relative `import` / `from` forms, at module
level, inside functions, and under `if TYPE_CHECKING:` alike, plus
`importlib.import_module("tokenmill...")` with a literal name. A module the
table does not place is an error too: add a row to the table.

Further checks: no import circle anywhere in tokenmill/ (the same imports,
TYPE_CHECKING ones included, at module granularity), `model/` never imports
`backends`, the front ends (server/, serve_ray/, cli.py) read only
EngineClient's members on an `engine` (an AST check of attribute chains), and
(in a subprocess) every module of `tokenmill.core`, with config,
sampling_params and outputs, imports with torch and numpy blocked.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO_ROOT / "tokenmill"
ARCHITECTURE_MD = REPO_ROOT / "docs" / "ARCHITECTURE.md"

ANYTHING = "*"


@dataclass(frozen=True)
class Rule:
    """`allowed`: module prefixes (without the `tokenmill.` prefix) a module may
    import; a prefix admits its submodules. `exact`: modules allowed only as
    themselves. `public_api`: `from tokenmill import NAME` for NAME in
    tokenmill.__all__. `forbidden`: exceptions carved out of ANYTHING."""

    allowed: tuple[str, ...] = ()
    exact: tuple[str, ...] = ()
    public_api: bool = False
    forbidden: tuple[str, ...] = ()


# ---- reading the table from docs/ARCHITECTURE.md ------------------------------------------

_BACKTICKED = re.compile(r"`([^`]+)`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_rule(cell: str) -> Rule:
    """One "may import" cell -> a Rule.

    `anything` -> every module; `anything except `a`, `b`` -> every module but
    those; `nothing` -> none; otherwise the backticked names, where `tokenmill`
    itself means its public API (`from tokenmill import NAME`, NAME in __all__)."""
    names = _BACKTICKED.findall(cell)
    text = cell.strip().lower()
    if text.startswith("anything"):
        return Rule(allowed=(ANYTHING,), forbidden=tuple(names))
    if text.startswith("nothing"):
        assert not names, f"'nothing' with names: {cell!r}"
        return Rule()
    assert names, f"a 'may import' cell names no module: {cell!r}"
    allowed = tuple(n for n in names if n != "tokenmill")
    if "tokenmill" in names:
        return Rule(allowed=allowed, exact=("",), public_api=True)
    return Rule(allowed=allowed)


def read_rules(markdown: str) -> dict[str, Rule]:
    """The §2 table of ARCHITECTURE.md: keys are files ("config.py") or package
    directories ("core/"), as its module column names them."""
    lines = markdown.splitlines()
    header = next(
        (i for i, line in enumerate(lines)
         if line.startswith("|") and "may import" in line.lower()),
        None,
    )
    assert header is not None, "ARCHITECTURE.md has no table with a 'may import' column"
    columns = [c.lower() for c in _cells(lines[header])]
    import_col = next(i for i, c in enumerate(columns) if "may import" in c)
    rules: dict[str, Rule] = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rule = parse_rule(cells[import_col])
        for key in _BACKTICKED.findall(cells[0]):
            assert key not in rules, f"{key} has two rows in ARCHITECTURE.md"
            rules[key] = rule
    # Every name a rule admits is something the table places (catches typos).
    top_level = {k.removesuffix("/").removesuffix(".py") for k in rules}
    for key, rule in rules.items():
        for name in (*rule.allowed, *rule.forbidden):
            if name != ANYTHING:
                assert name.split(".")[0] in top_level, f"{key}: `{name}` is not a row of the table"
    return rules


RULES: dict[str, Rule] = read_rules(ARCHITECTURE_MD.read_text())


# ---- collecting imports --------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    target: str  # a dotted module inside tokenmill, e.g. "tokenmill.core.request"
    name: str | None  # for `from tokenmill import NAME` when NAME is not a module
    lineno: int


def module_name(path: Path) -> str:
    """tokenmill/core/request.py -> tokenmill.core.request; .../__init__.py -> the package."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    """Whether a dotted name is a module or package in this checkout."""
    base = REPO_ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        package = package[: len(package) - (level - 1)]
    return ".".join([*package, name] if name else package)


def collect_imports(source: str, module: str, is_package: bool) -> list[Import]:
    """Every tokenmill import anywhere in `source` (module `module`)."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                Import(alias.name, None, node.lineno)
                for alias in node.names
                if alias.name == "tokenmill" or alias.name.startswith("tokenmill.")
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = resolve_relative(module, is_package, node.level, node.module)
            if not (base == "tokenmill" or base.startswith("tokenmill.")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and is_module(sub):
                    found.append(Import(sub, None, node.lineno))  # `from pkg import submodule`
                else:
                    found.append(Import(base, alias.name, node.lineno))
        elif isinstance(node, ast.Call):
            func = node.func
            func_name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if (
                func_name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith("tokenmill")
            ):
                found.append(Import(node.args[0].value, None, node.lineno))
    return found


def public_api_names() -> set[str]:
    """tokenmill.__all__, read without importing tokenmill."""
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return set(value)
    raise AssertionError("tokenmill/__init__.py defines no __all__")


# ---- checking them ---------------------------------------------------------------------


def rule_key(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE_DIR)
    key = f"{rel.parts[0]}/" if len(rel.parts) > 1 else rel.parts[0]
    return key if key in RULES else None


def _under(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def violation(rule: Rule, imp: Import, api_names: set[str]) -> str | None:
    """Why `imp` breaks `rule`, or None when it is allowed."""
    target = imp.target.removeprefix("tokenmill").removeprefix(".")  # "" = tokenmill itself
    if ANYTHING in rule.allowed:
        if any(_under(target, f) for f in rule.forbidden):
            return f"may not import tokenmill.{target}"
        return None
    if target and any(_under(target, p) for p in rule.allowed):
        return None
    if target in rule.exact:
        if target == "" and rule.public_api and imp.name is not None:
            if imp.name in api_names:
                return None
            return f"`from tokenmill import {imp.name}`: {imp.name} is not in tokenmill.__all__"
        return None
    shown = f"tokenmill.{target}" if target else "tokenmill"
    if imp.name is not None:
        shown = f"{shown} (name {imp.name})"
    return f"may not import {shown}"


MODULE_PATHS = sorted(PACKAGE_DIR.rglob("*.py"))


def test_the_package_is_found() -> None:
    names = {module_name(p) for p in MODULE_PATHS}
    assert {"tokenmill", "tokenmill.config", "tokenmill.core.scheduler"} <= names


@pytest.mark.parametrize(
    "path", MODULE_PATHS, ids=[str(p.relative_to(REPO_ROOT)) for p in MODULE_PATHS]
)
def test_imports_follow_the_table(path: Path) -> None:
    key = rule_key(path)
    assert key is not None, (
        f"{path.relative_to(REPO_ROOT)} is not in docs/ARCHITECTURE.md §2's table: add a "
        "row there"
    )
    rule = RULES[key]
    module = module_name(path)
    imports = collect_imports(path.read_text(), module, path.name == "__init__.py")
    api_names = public_api_names()
    problems = [
        f"{path.relative_to(REPO_ROOT)}:{imp.lineno}: {key} {why}"
        for imp in imports
        if (why := violation(rule, imp, api_names)) is not None
    ]
    assert not problems, "docs/ARCHITECTURE.md §2 broken:\n" + "\n".join(problems)


# ---- no import circle; model/ never imports the CPU backend -------------------------------


def import_graph() -> dict[str, set[str]]:
    """Module -> the tokenmill modules it imports (every form, TYPE_CHECKING included).
    An import of a name from a package is an edge to the package's __init__; the
    parent packages Python runs on the way to a submodule are not edges."""
    modules = {module_name(p): p for p in MODULE_PATHS}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        imports = collect_imports(path.read_text(), module, path.name == "__init__.py")
        graph[module] = {imp.target for imp in imports if imp.target in modules} - {module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle() -> None:
    graph = import_graph()
    circles = import_circles(graph)
    described = [
        " <-> ".join(c) + ": " + "; ".join(
            f"{a} imports {b}" for a in c for b in sorted(graph[a]) if b in c
        )
        for c in circles
    ]
    assert not circles, "import circles in tokenmill/:\n" + "\n".join(described)


def test_import_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_model_never_imports_the_cpu_backend() -> None:
    problems = [
        f"{path.relative_to(REPO_ROOT)}:{imp.lineno}: imports {imp.target}"
        for path in MODULE_PATHS
        if rule_key(path) == "model/"
        for imp in collect_imports(path.read_text(), module_name(path), path.name == "__init__.py")
        if _under(imp.target, "tokenmill.backends")
    ]
    assert not problems, "model/ imports the CPU backend:\n" + "\n".join(problems)


# ---- the checker itself ---------------------------------------------------------------


def test_collect_imports_sees_every_form() -> None:
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        import os
        import tokenmill.config
        import tokenmill.core.request as request_module
        from tokenmill.sampling_params import SamplingParams
        from tokenmill.core import contracts, scheduler
        from tokenmill import SamplingParams as SP
        from . import sibling_name
        from ..config import CacheConfig
        from .block_pool import BlockPool

        if TYPE_CHECKING:
            from tokenmill.engine.llm import LLM

        def lazy():
            import tokenmill.worker.sampler
            import importlib
            return importlib.import_module("tokenmill.server.app")
        """
    )
    found = collect_imports(source, "tokenmill.core.kv_cache_manager", is_package=False)
    assert [(i.target, i.name) for i in sorted(found, key=lambda i: i.lineno)] == [
        ("tokenmill.config", None),
        ("tokenmill.core.request", None),
        ("tokenmill.sampling_params", "SamplingParams"),
        ("tokenmill.core.contracts", None),
        ("tokenmill.core.scheduler", None),
        ("tokenmill", "SamplingParams"),
        ("tokenmill.core", "sibling_name"),
        ("tokenmill.config", "CacheConfig"),
        ("tokenmill.core.block_pool", "BlockPool"),
        ("tokenmill.engine.llm", "LLM"),
        ("tokenmill.worker.sampler", None),
        ("tokenmill.server.app", None),
    ]
    # In a package's __init__, `.` is the package itself.
    (imp,) = collect_imports("from .x import y", "tokenmill.core", is_package=True)
    assert imp.target == "tokenmill.core.x"


@pytest.mark.parametrize(
    ("key", "target", "name", "ok"),
    [
        ("core/", "tokenmill.config", None, True),
        ("core/", "tokenmill.core.request", None, True),
        ("core/", "tokenmill.outputs", None, False),
        ("core/", "tokenmill.worker.sampler", None, False),
        ("core/", "tokenmill", "SamplingParams", False),
        ("worker/", "tokenmill.core.contracts", None, True),
        ("worker/", "tokenmill.core.scheduler", None, False),
        ("worker/", "tokenmill.core", None, False),
        ("worker/", "tokenmill.model.llama", None, True),
        ("model/", "tokenmill.sampling_params", None, False),
        ("config.py", "tokenmill.sampling_params", None, False),
        ("tokenizer.py", "tokenmill.config", None, True),
        ("engine/", "tokenmill.core.scheduler", None, True),
        ("engine/", "tokenmill.server.app", None, False),
        ("server/", "tokenmill.engine.llm", None, True),
        ("server/", "tokenmill.core.scheduler", None, False),
        ("bench/", "tokenmill", "LLM", True),
        ("bench/", "tokenmill", None, True),
        ("bench/", "tokenmill", "engine_internals", False),
        ("bench/", "tokenmill.outputs", None, True),
        ("bench/", "tokenmill.engine.llm", None, False),
        ("cli.py", "tokenmill.engine.llm", None, True),
        ("__init__.py", "tokenmill.engine.llm", None, True),
        ("model/", "tokenmill.backends.cpu.plan", None, False),
        ("model/", "tokenmill.model.attention", None, True),
        ("backends/", "tokenmill.model.llama", None, True),
        ("backends/", "tokenmill.config", None, True),
        ("backends/", "tokenmill.backends.cpu.kernels", None, True),
        ("backends/", "tokenmill.worker.model_runner", None, False),
        ("backends/", "tokenmill.core.scheduler", None, False),
        ("worker/", "tokenmill.backends.cpu.plan", None, True),
        ("core/", "tokenmill.backends", None, False),
        ("engine/", "tokenmill.backends.cpu.kernels", None, True),
        ("engine/", "tokenmill.bench.report", None, False),
        ("engine/", "tokenmill.cli", None, False),
        ("outputs.py", "tokenmill.config", None, False),
    ],
)
def test_the_table_rejects_what_it_should(
    key: str, target: str, name: str | None, ok: bool
) -> None:
    why = violation(RULES[key], Import(target, name, 1), {"LLM", "SamplingParams"})
    assert (why is None) is ok, why


def test_the_table_is_read_from_the_document() -> None:
    assert {"config.py", "sampling_params.py", "outputs.py", "core/", "model/", "backends/",
            "worker/", "tokenizer.py", "engine/", "server/", "bench/", "cli.py",
            "__init__.py"} <= set(RULES)
    assert RULES["config.py"] == Rule()
    assert RULES["model/"] == Rule(allowed=("config", "model", "envs"))
    assert RULES["backends/"] == Rule(allowed=("config", "model", "backends", "envs"))
    assert RULES["envs.py"] == Rule()
    assert RULES["engine/"].forbidden == ("server", "bench", "cli")
    assert RULES["bench/"].public_api and RULES["bench/"].exact == ("",)


def test_parse_rule() -> None:
    assert parse_rule("nothing") == Rule()
    assert parse_rule("anything") == Rule(allowed=(ANYTHING,))
    assert parse_rule("anything except `server`, `cli`") == Rule(
        allowed=(ANYTHING,), forbidden=("server", "cli"))
    assert parse_rule("`config`, `core.contracts` only") == Rule(
        allowed=("config", "core.contracts"))
    assert parse_rule("`tokenmill` (its public API), `bench`") == Rule(
        allowed=("bench",), exact=("",), public_api=True)
    table = textwrap.dedent(
        """
        | module | does | may import |
        |---|---|---|
        | `a.py`, `b.py` | x | nothing |
        | `c/` | y | `a`, `c` |
        """
    )
    assert read_rules(table) == {"a.py": Rule(), "b.py": Rule(), "c/": Rule(allowed=("a", "c"))}
    with pytest.raises(AssertionError, match="not a row"):
        read_rules(table.replace("`a`, `c`", "`a`, `typo`"))


# ---- the front ends reach the engine through its interface only ---------------------------

# docs/ARCHITECTURE.md §2: in these, an object named `engine` is an EngineClient.
FRONT_ENDS = ("server/", "serve_ray/", "cli.py")


def engine_client_members() -> set[str]:
    """The members of EngineClient (engine/client.py), read without importing it."""
    tree = ast.parse((PACKAGE_DIR / "engine" / "client.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineClient"]
    members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    members |= {n.target.id for n in cls.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return members


def _names_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def reaches_through_engine(source: str, members: set[str]) -> list[tuple[int, str]]:
    """(line, attribute) for each read on an `engine` (a name or an attribute)
    of something that is not one of `members`, `getattr(engine, "x")` included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _names_engine(node.value):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and _names_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            name = node.args[1].value
        else:
            continue
        if name not in members:
            found.append((node.lineno, name))
    return found


def test_engine_client_is_read() -> None:
    members = engine_client_members()
    assert {"facts", "tokenizer", "add_request", "abort", "stats"} <= members
    assert "engine" not in members


@pytest.mark.parametrize(
    "path", [p for p in MODULE_PATHS if rule_key(p) in FRONT_ENDS],
    ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_front_ends_use_the_engine_client_only(path: Path) -> None:
    problems = [f"{path.relative_to(REPO_ROOT)}:{line}: engine.{name} is not a member of "
                "EngineClient (engine/client.py); add what the front end needs there"
                for line, name in reaches_through_engine(path.read_text(), engine_client_members())]
    assert not problems, "docs/ARCHITECTURE.md §2 broken:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("self.engine.facts.max_model_len", []),
        ("engine.add_request(r, p, s)", []),
        ("x = engine", []),
        ("engine.engine.tokenizer", ["engine"]),
        ("self.engine.engine.scheduler.kv.num_blocks", ["engine", "scheduler"]),
        ("served.engine.scheduler", ["scheduler"]),
        ("engine._tokenizer()", ["_tokenizer"]),
        ("getattr(self.engine, 'tp', None)", ["tp"]),
        ("getattr(self.engine.engine, 'tp', None)", ["engine", "tp"]),
    ],
)
def test_reaching_through_the_engine_is_found(source: str, bad: list[str]) -> None:
    members = {"facts", "add_request", "tokenizer"}
    assert sorted(name for _, name in reaches_through_engine(source, members)) == sorted(bad)


# ---- the core imports without torch or numpy ---------------------------------------------

NO_TORCH_SCRIPT = """
import sys

BLOCKED = ("torch", "numpy")

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

for loaded in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[loaded]
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, sys.argv[1])

try:
    import numpy  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker does not work")

import importlib
import pkgutil

import tokenmill
import tokenmill.config
import tokenmill.core
import tokenmill.outputs
import tokenmill.sampling_params

core_modules = [m.name for m in pkgutil.iter_modules(tokenmill.core.__path__, "tokenmill.core.")]
assert "tokenmill.core.scheduler" in core_modules, core_modules
for name in core_modules:
    importlib.import_module(name)

leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("ok")
"""


def test_core_imports_without_torch_or_numpy() -> None:
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT, str(REPO_ROOT)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
