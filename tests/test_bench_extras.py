"""A benchmark whose `bench` extra is missing says how to install it, before it runs."""

from __future__ import annotations

import pytest

from tokenmill.bench import extras


def test_require_names_the_install_command() -> None:
    extras.require("json")  # present: nothing happens
    with pytest.raises(ImportError, match=r"no_such_package_xyz .*pip install 'tokenmill\[bench\]'"):
        extras.require("json", "no_such_package_xyz")


def test_the_extra_lists_what_bench_imports() -> None:
    assert set(extras.BENCH_PACKAGES) == {"matplotlib", "aiohttp", "httpx"}
