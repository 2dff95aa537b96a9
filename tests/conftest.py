"""Shared test set-up."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The tiny test models are far faster on one thread (intra-op overhead dominates)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
#: What a test run may leave at the repository's top level (caches).
_MAY_APPEAR = {".pytest_cache", ".hypothesis", "__pycache__", ".ruff_cache", ".mypy_cache"}


def pytest_sessionstart(session):
    session.config._gna_root_entries = {p.name for p in _ROOT.iterdir()}


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the checkout (a scan without ``--out``, a report in the current
    folder) fails the run: its output would be committed by the next ``git add``."""
    before = getattr(session.config, "_gna_root_entries", None)
    if before is None:
        return
    new = sorted({p.name for p in _ROOT.iterdir()} - before - _MAY_APPEAR)
    if new:
        print(
            f"\ntests wrote into the repository's top level: {new}; write to tmp_path instead "
            "(e.g. pass --out tmp_path / ... to the CLI)."
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _device_rule():
    """Every test runs under the run-time device guard: a tensor factory called from gna_lens
    without ``device=`` fails the test that reached it (``tests/device_guard.py``)."""
    import os

    from device_guard import FactoryGuard

    if os.environ.get("GNA_NO_GUARD"):
        yield
        return
    with FactoryGuard():
        yield
