"""Loading a script of benchmarks/ as a module (the scripts are not a package)."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(path: str | Path, name: str | None = None) -> ModuleType:
    """The script ``path`` (a file name in benchmarks/, or a path) imported as module ``name``:
    its module level runs (every script guards its main)."""
    path = BENCHMARKS / path if isinstance(path, str) else path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
