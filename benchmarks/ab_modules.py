"""Load a kernel build by its name (`kernels.load()` names it) so that two builds can run side by side in one process (step_ab.py, gemm_ab.py)."""

from __future__ import annotations

import glob
import importlib.util
import os
from types import ModuleType


def load_module(name: str) -> ModuleType:
    """The extension module torch's cpp_extension built as `name`."""
    pattern = os.path.expanduser(f"~/.cache/torch_extensions/py*_cpu/{name}/{name}.so")
    paths = glob.glob(pattern)
    if not paths:
        raise SystemExit(f"no build named {name} ({pattern})")
    spec = importlib.util.spec_from_file_location(name, paths[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
