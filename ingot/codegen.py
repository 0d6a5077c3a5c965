"""Generated kernels as modules: each source is written once under the cache directory, named by the
hash of its text, and imported, so tools that read a function's file (Triton's jit, numba's on-disk
cache) see a real one, and a second process finds the compiled kernel already there.

    >>> fn = load("def double(x):\\n    return 2 * x\\n", "double", "doctest")   # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile

from .options import cache_dir

_MODULES: dict[tuple[str, str], object] = {}


def folder(name: str) -> str:
    """cache_dir()/name, created; a temporary folder where the cache is not writable."""
    path = os.path.join(cache_dir(), name)
    try:
        os.makedirs(path, exist_ok=True)
        return path
    except OSError:
        path = os.path.join(tempfile.gettempdir(), f"ingot_{name}")
        os.makedirs(path, exist_ok=True)
        return path


def load(source: str, name: str, where: str):
    """The object `name` of the module `source`, written under folder(where) by its hash and imported
    (once per process)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    if (key, name) in _MODULES:
        return _MODULES[key, name]
    path = os.path.join(folder(where), f"{where}_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"ingot_{where}_{key}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    _MODULES[key, name] = getattr(module, name)
    return _MODULES[key, name]
