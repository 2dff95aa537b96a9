"""Every script in benchmarks/ imports against the current library.

The benchmarks are run by hand, not by the test suite, so a moved or renamed library module would
otherwise break them silently (this happened once: two scripts imported a module that had been split).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import BENCHMARKS as FOLDER
from bench_helpers import load_benchmark

BENCHMARKS = sorted(FOLDER.glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5, BENCHMARKS


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports(path: Path) -> None:
    load_benchmark(path, f"_bench_{path.stem}")  # module level only: every script guards its main
