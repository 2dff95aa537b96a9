"""Device mixing caught without a GPU: the model on torch's ``meta`` device.

A tensor made on the CPU inside a hook (``HOST`` where the model's device was meant) works on a
CPU-only machine and fails on a GPU, where CI never looks. Meta tensors refuse to mix with CPU
tensors just as CUDA ones do ("Tensor on device cpu is not on the expected device meta"), and a
forward on the meta device computes shapes only, so every intervention that installs hooks can
run here on a model moved to ``meta``: a host tensor inside a hook fails the test.
"""

import copy

import pytest
import torch
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions.ablation as ablation_module
from gna_lens.device import HOST
from gna_lens.interventions import (
    ablate_heads,
    ablate_layers,
)
from gna_lens.interventions.sources import column_mask

ARCHS = ("mamba2", "bamba", "zamba2")  # Mamba-1 scans and bridges read values: not on meta


def _on_meta(arch):
    """A copy of the helper's model on the meta device (the helper's own is shared), and a
    KV prompt's token ids there."""
    m = copy.deepcopy(helper_model(arch)).to("meta")
    sample = make_task()[0]
    ids = torch.tensor([list(sample.input_ids)], device="meta")
    return m, ids, sample


def _interventions(m):
    """The ablations, with explicit positions (the path that builds a column mask inside the
    hook). Pattern masks read index values inside their hook (no data on meta): the cuda suite
    covers them."""
    heads = [(0, 0), (1, 1)]
    yield "ablate_heads zero, positions [1, 3]", ablate_heads(m, heads, positions=[1, 3])
    yield "ablate_heads zero, last", ablate_heads(m, heads, positions="last")
    yield "ablate_layers, positions [2]", ablate_layers(m, [0], positions=[2])


@pytest.mark.parametrize("arch", ARCHS)
def test_interventions_keep_the_model_device_inside_their_hooks(arch):
    m, ids, _ = _on_meta(arch)
    with torch.no_grad():
        clean = m(ids)
        assert clean.device.type == "meta"
        for label, ctx in _interventions(m):
            with ctx:
                out = m(ids)
            assert out.device.type == "meta" and out.shape == clean.shape, label


def test_a_host_mask_inside_the_ablation_hook_is_caught(monkeypatch):
    """The planted bug: the ablation hook builds its column mask on the host."""
    monkeypatch.setattr(
        ablation_module, "column_mask", lambda positions, n, device: column_mask(positions, n, HOST)
    )
    m, ids, _ = _on_meta("mamba2")
    with (
        torch.no_grad(),
        ablate_heads(m, [(0, 0)], positions=[1, 3]),
        pytest.raises(RuntimeError, match="device"),
    ):
        m(ids)
    monkeypatch.undo()
    with torch.no_grad(), ablate_heads(m, [(0, 0)], positions=[1, 3]):
        assert m(ids).device.type == "meta"
