"""The kernel dispatch of the fast path, and the budgeted materialization of patterns.

mamba_ssm and causal_conv1d need CUDA, so these tests install FAKE kernel modules (``sys.modules``)
written here from the kernels' documented signatures and semantics (plain sequential recurrences
and an explicit tap sum, independent of :mod:`gna_lens.models.ops`), and open the CUDA condition
through the ``_kernel_device_ok`` seam. They check that the fast path calls the kernels with the
right layouts (the output must match the reference), records which path ran, and falls back to the
reference where a hook, a dtype or the switch asks for it. A fake that permutes the heads must
fail the parity check (``test_a_wrong_kernel_fails_the_parity_check``).
"""

import importlib
import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from gna_lens.errors import ConfigError
from gna_lens.models import kernels
from gna_lens.models.kernels import PatternJob, kernel_paths, pattern_budget, use_kernels
from gna_lens.testing import tiny_hooked_ssm

TOKENS = torch.randint(2, 60, (2, 37), generator=torch.Generator().manual_seed(0))
PATTERN = "blocks.0.mixer.hook_pattern"
#: Fake kernel vs reference, fp32 logits of the tiny models (sequential recurrence vs chunked
#: SSD / step scan: the same sums in another order). Measured: at most 2e-6.
PARITY_ATOL = 2e-5


# ----------------------------------------------------------------------------- fake kernels
def fake_mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """mamba_ssm's SSD, as documented: x (b, l, h, p), dt (b, l, h), A (h,), B / C (b, l, g, n),
    out (b, l, h, p) in x's dtype; computed as the plain recurrence in fp32."""
    b, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    assert H % G == 0 and A.shape == (H,) and dt.shape == (b, L, H) and C.shape == B.shape
    assert isinstance(chunk_size, int) and chunk_size > 0
    assert seq_idx is None and cu_seqlens is None and not return_varlen_states
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = B.float().repeat_interleave(H // G, dim=2)
    Ch = C.float().repeat_interleave(H // G, dim=2)
    xf = x.float()
    state = torch.zeros(b, H, P, N) if initial_states is None else initial_states.float()
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, t] * A.float())[..., None, None]
        state = decay * state + (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def fake_selective_scan_fn(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
):
    """mamba_ssm's selective scan, as documented: u / delta (b, d, l), A (d, n), B / C (b, n, l)
    or (b, g, n, l), out (b, d, l) in u's dtype; the plain recurrence in fp32."""
    b, d, L = u.shape
    assert delta.shape == u.shape and A.shape[0] == d and A.dtype == torch.float32
    assert delta.dtype == u.dtype and B.dtype == u.dtype, "variable B has the input dtype"
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]
    Bd = B.float().repeat_interleave(d // B.shape[1], dim=1)  # (b, d, n, l)
    Cd = C.float().repeat_interleave(d // C.shape[1], dim=1)
    state = torch.zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        state = (
            torch.exp(delta[:, :, t, None] * A) * state + (delta * u)[:, :, t, None] * Bd[..., t]
        )
        ys.append((state * Cd[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype_in)
    return (y, state) if return_last_state else y


def fake_causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """causal-conv1d's convolution, as documented: x (b, d, l), weight (d, w), bias (d,), out
    (b, d, l); the layout and width checks of the CUDA extension, then an explicit tap sum."""
    b, d, L = x.shape
    w = weight.shape[-1]
    assert weight.shape == (d, w), "weight is (dim, width)"
    assert 2 <= w <= 4, "causal_conv1d only supports width between 2 and 4"
    assert x.stride(2) == 1 or x.stride(1) == 1
    if x.stride(1) == 1 and x.stride(2) > 1:  # channel-last
        assert d % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
    assert activation in (None, "silu", "swish")
    assert bias is None or bias.dtype == weight.dtype
    FAKE_CALLS[f"conv:{activation}"] += 1
    out = torch.zeros(b, d, L, dtype=torch.float32)
    for k in range(w):  # tap k reads position t - (w - 1 - k)
        shift = w - 1 - k
        out[:, :, shift:] += weight[:, k, None].float() * x[:, :, : L - shift].float()
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


FAKE_CALLS: Counter = Counter()


def _counted(name, fn):
    def call(*args, **kwargs):
        FAKE_CALLS[name] += 1
        return fn(*args, **kwargs)

    return call


#: Hugging Face modeling modules that bind mamba_ssm's functions when first imported
#: (transformers' ``use_kernel_func_from_hub_with_fallback`` resolves them at decoration time).
_HF_MODELING = [
    f"transformers.models.{m}.modeling_{m}"
    for m in ("mamba", "falcon_mamba", "mamba2", "bamba", "jamba", "nemotron_h",
              "granitemoehybrid", "falcon_h1", "zamba2")
]  # fmt: skip


def _install(monkeypatch, ssd=fake_mamba_chunk_scan_combined, scan=fake_selective_scan_fn):
    """Put fake mamba_ssm / causal_conv1d modules in sys.modules and open the CUDA seam.

    Transformers' modeling modules are imported first, so that they bind their real (PyTorch)
    fallbacks: imported while the fakes are in sys.modules, they would keep the fakes for the
    rest of the process and break later Hugging Face parity tests (they did, when this file ran
    before test_hooked_ssm.py)."""
    for name in _HF_MODELING:
        importlib.import_module(name)
    FAKE_CALLS.clear()
    mods = {n: types.ModuleType(n) for n in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton")}
    ssd_mod = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd_mod.mamba_chunk_scan_combined = _counted("ssd", ssd)
    scan_mod = types.ModuleType("mamba_ssm.ops.selective_scan_interface")
    scan_mod.selective_scan_fn = _counted("scan", scan)
    conv_mod = types.ModuleType("causal_conv1d")
    conv_mod.causal_conv1d_fn = fake_causal_conv1d_fn
    mods |= {m.__name__: m for m in (ssd_mod, scan_mod, conv_mod)}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(kernels, "_kernel_device_ok", lambda *tensors: True)
    kernels.refresh()


@pytest.fixture
def fakes(monkeypatch):
    _install(monkeypatch)
    yield FAKE_CALLS
    kernels.refresh()


def _logits(model, tokens=TOKENS, hooks=()):
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=list(hooks))


# ----------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_on_the_cpu_without_kernels_every_path_is_the_reference(arch):
    model = tiny_hooked_ssm(arch)
    _logits(model)
    paths = kernel_paths(model)
    assert set(paths) == {f"blocks.{i}.mixer" for i in range(model.cfg.n_layers)}
    for path in paths.values():
        assert path["conv"] == "torch.conv1d" and path["scan"].startswith("torch.")
    # The packages are never imported for CPU tensors (no import cost, no side effects).
    assert all(v == "not checked" for k, v in kernels.kernel_status().items() if k != "enabled")


CASES = [
    ("mamba1", {}),
    ("mamba1", {"hidden_size": 18}),  # 36 channels: channel-last strides the kernel refuses
    ("falcon_mamba", {}),
    ("mamba2", {}),
    ("mamba2", {"n_groups": 2, "chunk_size": 8}),
    ("bamba", {}),
]


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_fake_kernels_give_the_reference_output_and_are_recorded(fakes, arch, overrides):
    model = tiny_hooked_ssm(arch, **overrides)

    def ssm_paths():  # hybrids' attention layers record {"attention": ...}
        return [p for p in kernel_paths(model).values() if "scan" in p]

    with use_kernels(False):
        ref = _logits(model)
    assert ssm_paths() and all(p["scan"].startswith("torch.") for p in ssm_paths())
    out = _logits(model)
    assert (out - ref).abs().max().item() < PARITY_ATOL
    mamba1 = arch in ("mamba1", "falcon_mamba")
    scan = "mamba_ssm." + ("selective_scan_fn" if mamba1 else "mamba_chunk_scan_combined")
    for path in ssm_paths():
        assert path == {"conv": "causal_conv1d.causal_conv1d_fn", "scan": scan}
    n_ssm = len(ssm_paths())
    assert fakes["ssd"] + fakes["scan"] == n_ssm and fakes["conv:silu"] == n_ssm
    if arch == "bamba":  # its attention layer runs the fused kernel beside them
        assert kernels.path_summary(model)["attention"] == ["torch.sdpa"]


def test_a_wrong_kernel_fails_the_parity_check(monkeypatch):
    """The parity check can fail: a kernel that mixes up the heads is caught."""

    def permuted(x, *args, **kwargs):
        return fake_mamba_chunk_scan_combined(x, *args, **kwargs).roll(1, dims=2)

    _install(monkeypatch, ssd=permuted)
    model = tiny_hooked_ssm("mamba2")
    with use_kernels(False):
        ref = _logits(model)
    assert (_logits(model) - ref).abs().max().item() > 100 * PARITY_ATOL
    kernels.refresh()


def test_gradients_flow_through_the_kernels(fakes):
    model = tiny_hooked_ssm("mamba2", n_groups=2, chunk_size=8)
    grads = {}
    for enabled in (False, True):
        model.zero_grad()
        with use_kernels(enabled):
            model(TOKENS, return_type="loss").backward()
        grads[enabled] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert fakes["ssd"] == 2
    for name, g in grads[False].items():
        assert torch.allclose(grads[True][name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_hooks_inside_the_kernels_fall_back_to_the_reference_and_say_so(fakes, arch):
    model = tiny_hooked_ssm(arch)
    with use_kernels(False):
        ref = _logits(model)
    kernel_scan = "mamba_ssm." + (
        "selective_scan_fn" if arch == "mamba1" else "mamba_chunk_scan_combined"
    )
    identity = lambda x, hook: x  # noqa: E731

    out = _logits(model, hooks=[(PATTERN, identity)])
    assert kernel_paths(model)["blocks.0.mixer"]["scan"] == "materialized"
    assert kernel_paths(model)["blocks.1.mixer"]["scan"] == kernel_scan
    assert (out - ref).abs().max().item() < PARITY_ATOL

    _logits(model, hooks=[("blocks.0.mixer.hook_ssm_state", identity)])
    assert kernel_paths(model)["blocks.0.mixer"]["scan"] == "torch.recurrent"

    with model.pattern_selection(heads=[1], query_positions="last"):
        _logits(model, hooks=[(PATTERN, identity)])
    assert kernel_paths(model)["blocks.0.mixer"]["scan"] == f"materialized+{kernel_scan}"

    # hook_conv reads the convolution before the SiLU: the kernel runs without its activation.
    FAKE_CALLS.clear()
    seen = []
    out = _logits(model, hooks=[("blocks.0.mixer.hook_conv", lambda x, hook: seen.append(x))])
    assert seen and FAKE_CALLS["conv:None"] == 1 and FAKE_CALLS["conv:silu"] == 1
    assert (out - ref).abs().max().item() < PARITY_ATOL

    # Hooks on what the kernel reads take effect on both paths alike.
    half_dt = [("blocks.0.mixer.hook_ssm_dt", lambda x, hook: x * 0.5)]
    with use_kernels(False):
        edited_ref = _logits(model, hooks=half_dt)
    assert (_logits(model, hooks=half_dt) - edited_ref).abs().max().item() < PARITY_ATOL
    assert (edited_ref - ref).abs().max().item() > 1e-3


def test_unsupported_arguments_and_the_switch_use_the_reference(fakes):
    model = tiny_hooked_ssm("mamba2").to(torch.float64)  # the kernels have no float64
    _logits(model)
    assert kernel_paths(model)["blocks.0.mixer"] == {"conv": "torch.conv1d", "scan": "torch.ssd"}
    model = tiny_hooked_ssm("mamba1", conv_kernel=5)  # causal_conv1d: widths 2 to 4
    _logits(model)
    assert kernel_paths(model)["blocks.0.mixer"] == {
        "conv": "torch.conv1d",
        "scan": "mamba_ssm.selective_scan_fn",
    }
    FAKE_CALLS.clear()
    with use_kernels(False):
        _logits(model)
    assert not FAKE_CALLS and kernel_paths(model)["blocks.0.mixer"]["scan"] == "torch.scan"
    assert kernels.kernel_status()["selective_scan_fn"] == "loaded"


def test_a_kernel_that_does_not_import_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # import raises ImportError
    monkeypatch.setattr(kernels, "_kernel_device_ok", lambda *tensors: True)
    kernels.refresh()
    out, path = kernels.causal_conv1d(torch.ones(1, 8, 3), torch.ones(8, 1, 2), None, silu=True)
    assert path == "torch.conv1d" and out.shape == (1, 8, 3)
    assert (
        "ModuleNotFoundError: import of causal_conv1d"
        in kernels.kernel_status()["causal_conv1d_fn"]
    )
    kernels.refresh()


# ----------------------------------------------------------------------------- budget
def _pattern_and_logits(model, budget, selection=None, rows=None):
    with torch.no_grad(), pattern_budget(budget), model.pattern_selection(selection, rows):
        logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: "hook_pattern" in n)
    return cache, logits


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("mamba2", {"n_groups": 2, "chunk_size": 8}), ("mamba1", {}), ("bamba", {})],
)
@pytest.mark.parametrize(("heads", "rows"), [(None, None), ([1, 2, 6], [3, -1])])
def test_a_small_budget_gives_the_same_patterns_and_output(arch, overrides, heads, rows):
    model = tiny_hooked_ssm(arch, **overrides)
    big, big_logits = _pattern_and_logits(model, "1GiB", heads, rows)
    # 16 KiB: chunks of one head (Mamba-1: one channel) and some query rows
    small, small_logits = _pattern_and_logits(model, 16384, heads, rows)
    assert set(big.keys()) == set(small.keys()) and len(big.keys()) >= 2
    for name in big:
        assert torch.equal(big[name], small[name]), name  # bit-identical on the CPU
    assert torch.equal(big_logits, small_logits)


def test_chunks_cover_the_pattern_once_within_the_budget():
    def cost(h, r):  # intermediates: 5% of the output (4 * 2 * h * r * 100 bytes)
        return 40 * h * r

    n_chunks = {}
    for budget in (10**9, 16000, 15000, 4000, 1):
        for backward in (False, True):
            job = PatternJob(
                build=lambda *a: torch.zeros(0), shape=(2, 8, 50, 100), rows=None, cost=cost,
                budget=budget, equation="",
            )  # fmt: skip
            chunks = job.chunks(backward)
            n_chunks[budget, backward] = len(chunks)
            seen = torch.zeros(8, 50, dtype=torch.int64)
            for h, r in chunks:
                seen[h, r] += 1
                size = job.chunk_bytes(h.stop - h.start, r.stop - r.start)
                assert (
                    (4 if backward else 1) * size <= budget
                    or (h.stop - h.start, r.stop - r.start) == (1, 1)
                    or len(chunks) == 1
                )
            assert (seen == 1).all()
    # Forward: one chunk (no copy) while the intermediates fit, however large the output.
    assert n_chunks[10**9, False] == n_chunks[16000, False] == 1 == n_chunks[10**9, True]
    assert n_chunks[15000, False] == 8 * 3  # one head, 17 rows (840 bytes a row) -> 3 x 17
    assert n_chunks[16000, True] == 8 * 13  # 4 x 840 bytes a row: 4 rows
    assert n_chunks[1, False] == n_chunks[1, True] == 8 * 50


def test_the_mixer_budget_takes_precedence_and_bad_budgets_are_refused(monkeypatch):
    model = tiny_hooked_ssm("mamba2")
    mixer = model.blocks[0].mixer
    sizes = []
    real = kernels._assemble

    def spy(job, *args):
        sizes.append((job.budget, len(job.chunks())))
        return real(job, *args)

    monkeypatch.setattr(kernels, "_assemble", spy)
    mixer.pattern_budget_bytes = 4096
    _pattern_and_logits(model, "1GiB")
    assert sizes[0][0] == 4096 and sizes[0][1] > 1 and sizes[1] == (2**30, 1)
    for bad in (0, -5, "lots", "12 parsecs", True):
        with pytest.raises(ConfigError, match=r"pattern_budget.*'512MiB'"), pattern_budget(bad):
            pass


@pytest.mark.parametrize(("arch", "budget"), [("mamba2", 16384), ("mamba1", 2**18)])
def test_gradients_through_an_unedited_pattern_keep_no_pattern(arch, budget):
    """With gradients, an unedited pattern is neither kept nor are its construction's
    intermediates: the backward pass rebuilds it in chunks (the gradients are the fast path's)."""
    model = tiny_hooked_ssm(arch)
    b, L = TOKENS.shape
    n_heads = model.cfg.n_heads if arch == "mamba2" else model.cfg.d_inner
    n_pattern = b * n_heads * L * L

    def grads_and_saved(hooks):
        saved = []  # tensors of the pattern's size kept for the backward pass

        def pack(t):
            if t.numel() == n_pattern and tuple(t.shape[-2:]) == (L, L):
                saved.append(tuple(t.shape))
            return t

        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pattern_budget(budget):
            loss = model.run_with_hooks(TOKENS, return_type="loss", fwd_hooks=hooks)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, saved

    fast, _ = grads_and_saved([])
    unedited, saved = grads_and_saved([(PATTERN, lambda x, hook: x)])
    assert saved == []
    edited, saved = grads_and_saved([(PATTERN, lambda x, hook: x * 1.0)])
    assert len(saved) == 1  # the edited pattern itself (by the matmul), no intermediate
    for name, g in fast.items():
        scale = g.abs().max().item() + 1e-6
        for got in (unedited, edited):
            assert (got[name] - g).abs().max().item() <= 1e-4 * scale, name


def test_a_backward_hook_on_the_pattern_gets_its_gradient():
    model = tiny_hooked_ssm("mamba2")
    got = []
    model.add_hook(PATTERN, lambda grad, hook: got.append(grad), dir="bwd")
    try:
        with pattern_budget(4096):
            model(TOKENS, return_type="loss").backward()
    finally:
        model.reset_hooks()
    assert got and got[0].shape == (2, model.cfg.n_heads, 37, 37) and got[0].abs().sum() > 0


# ----------------------------------------------------------------------------- recorded paths
def test_attention_records_fused_or_materialized():
    model = tiny_hooked_ssm("bamba")
    _logits(model)
    assert kernels.path_summary(model)["attention"] == ["torch.sdpa"]
    names = [n for n in model.hook_dict if n.endswith("hook_pattern") and ".attn." in n]
    assert names, "bamba's tiny config has an attention layer"
    model.run_with_cache("a b c", names_filter=names[0])
    assert kernels.path_summary(model)["attention"] == ["materialized"]


def test_a_ranking_records_the_forward_paths():
    from gna_lens import score_heads
    from gna_lens.testing import toy_gna_model, toy_gna_task

    model = toy_gna_model()
    report = score_heads(model, toy_gna_task(model), control=None, progress=False)
    assert report.method["forward_paths"] == {"attention": ["torch.sdpa"]}
