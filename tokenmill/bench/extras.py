"""The packages of the `bench` extra, checked when a benchmark starts rather than after it ran."""

from __future__ import annotations

import importlib.util

# What each package of the extra is for (pyproject.toml, [project.optional-dependencies] bench).
BENCH_PACKAGES = {"matplotlib": "the plots", "aiohttp": "the serving benchmarks' streaming client",
                  "httpx": "plain requests (health, metrics)"}


def require(*names: str) -> None:
    """Raise ImportError naming the install command if any of `names` is missing."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        needs = ", ".join(f"{name} ({BENCH_PACKAGES.get(name, 'benchmarks')})" for name in missing)
        raise ImportError(
            f"this benchmark needs {needs}: pip install 'tokenmill[bench]' "
            "(`make setup` installs it)"
        )
