"""The device rule holds in gna_lens's source, and both guards catch a planted breach.

The planted breach is the bug a GPU user met first: the sweep's baseline made with
``torch.zeros(n)`` (on the CPU) and filled with the model's values. On a CPU-only machine that
runs fine, so only a guard can fail it here.
"""

import inspect

import pytest
import torch
from device_guard import DeviceRuleError, FactoryGuard, library_violations, violations
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions.engine as engine
from gna_lens.interventions import ablation_sweep

GOOD = "baseline=host_full(n),"
PLANTED = "baseline=torch.zeros(n),"


def _planted_engine_source() -> str:
    source = inspect.getsource(engine)
    assert source.count(GOOD) == 1, "the sweep's baseline line moved; update the planted bug"
    return source.replace(GOOD, PLANTED)


def test_library_follows_the_device_rule():
    found = library_violations()
    assert not found, "tensors made without saying where they go:\n" + "\n".join(found)


def test_static_guard_fails_on_a_planted_zeros_in_the_sweep():
    found = violations(_planted_engine_source(), engine.__file__)
    assert len(found) == 1 and "torch.zeros(...) without device=" in found[0], found


@pytest.mark.parametrize(
    ("code", "caught"),
    [
        ("x = torch.full((n,), 0.0)", True),
        ("x = torch.full((n,), 0.0, device=HOST)", False),
        ("self.w = nn.Parameter(torch.zeros(n))", False),  # module state moves with the module
        ("y = logits.cuda()", True),
        ("y = logits.cpu()", True),
        ("y = logits.to('cpu')", True),
        ("y = logits.to(device)", False),
        ("y = torch.zeros_like(logits)", False),  # inherits the device of its argument
        # literal devices: the value lands on the CPU whatever the model's device
        ("x = torch.zeros(n, device='cpu')", True),
        ("y = logits.to(device='cpu')", True),
        ("d = torch.device('cpu')", True),
        ("x = torch.ones(n, device='cuda:0')", True),
        ("x = torch.from_numpy(a)", True),
        ("x = torch.Tensor(n)", True),
        ("x = torch.zeros(n, device=HOST)", False),  # the named host: results, by the rule
    ],
)
def test_static_guard_rules(code, caught):
    assert bool(violations(code, "gna_lens/somewhere.py")) is caught


def test_dynamic_guard_fails_on_a_planted_zeros_in_the_sweep(monkeypatch):
    """The same plant, run: compiled under the engine's own file name, so the guard sees a
    gna_lens frame make the tensor."""
    namespace = dict(vars(engine))
    exec(compile(_planted_engine_source(), engine.__file__, "exec"), namespace)
    monkeypatch.setattr(engine, "run_cells", namespace["run_cells"])  # what CellSweep.run calls
    m, t = helper_model("mamba2"), make_task()
    with FactoryGuard(), pytest.raises(DeviceRuleError, match=r"engine\.py:\d+: torch\.zeros"):
        ablation_sweep(m, t, "logit_diff", heads=[(0, 0)], progress=False)
    monkeypatch.undo()
    with FactoryGuard() as guard:  # the real engine passes, having checked its factories
        ablation_sweep(m, t, "logit_diff", heads=[(0, 0)], progress=False)
    assert guard.checked > 0


def test_dynamic_guard_leaves_other_code_alone():
    with FactoryGuard():
        torch.zeros(3)  # the caller is a test, not gna_lens
