"""ARCHITECTURE.md §2: what each module may import inside tokenmill.

Every module under tokenmill/ is parsed (never imported) and each of its
`tokenmill.*` imports is checked against the table below: absolute and
relative `import` / `from` forms, at module level, inside functions, and under
`if TYPE_CHECKING:` alike, plus `importlib.import_module("tokenmill...")` with a
literal name. A module the table does not place is an error too: add it to
ARCHITECTURE.md §2 and to `RULES` here in the same change.

A subprocess then checks the other half of the core's row: `tokenmill.core`
(and config, sampling_params, outputs) import with torch and numpy blocked.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO_ROOT / "tokenmill"

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


# ARCHITECTURE.md §2, row by row. Keys: a file, or a package directory ("core/").
RULES: dict[str, Rule] = {
    "__init__.py": Rule(allowed=(ANYTHING,)),  # the public API re-exports
    "cli.py": Rule(allowed=(ANYTHING,)),  # the command line sits on top
    "config.py": Rule(),
    "sampling_params.py": Rule(),
    "outputs.py": Rule(),
    "core/": Rule(allowed=("config", "sampling_params", "core")),
    "model/": Rule(allowed=("config", "model")),
    "backends/": Rule(allowed=("config", "model", "backends")),
    "worker/": Rule(
        allowed=("config", "sampling_params", "model", "backends", "worker"),
        exact=("core.contracts",),
    ),
    "tokenizer.py": Rule(allowed=("config",)),
    # "all of the above except server": nothing below engine either (no backward calls).
    "engine/": Rule(allowed=(ANYTHING,), forbidden=("server", "bench", "cli")),
    "server/": Rule(allowed=("engine", "sampling_params", "outputs", "config", "server")),
    # bench: the public API (or HTTP) only.
    "bench/": Rule(allowed=("sampling_params", "outputs", "bench"), exact=("",), public_api=True),
}


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
        f"{path.relative_to(REPO_ROOT)} is not in ARCHITECTURE.md §2's table: add a row "
        "there and an entry to RULES in tests/test_architecture.py"
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
    assert not problems, "ARCHITECTURE.md §2 broken:\n" + "\n".join(problems)


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
    ],
)
def test_the_table_rejects_what_it_should(
    key: str, target: str, name: str | None, ok: bool
) -> None:
    why = violation(RULES[key], Import(target, name, 1), {"LLM", "SamplingParams"})
    assert (why is None) is ok, why


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

import tokenmill
import tokenmill.config
import tokenmill.core.block_pool
import tokenmill.core.contracts
import tokenmill.core.kv_cache_manager
import tokenmill.core.request
import tokenmill.core.scheduler
import tokenmill.outputs
import tokenmill.sampling_params

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
