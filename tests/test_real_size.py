"""Real-size cost: Mamba-1 attribution on the differentiable fast scan, rows-only streamed
pattern scores."""

import functools

import pytest
import torch
from interventions_helpers import task as make_task
from interventions_helpers import tok, tokens

import gna_lens.interventions as I
from gna_lens.heads import head_view
from gna_lens.interventions.metrics import Metric
from gna_lens.models import ops


def _scan_inputs(seed=0, b=2, length=11, e=5, n=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(b, length, e, generator=g, dtype=dtype)
    delta = torch.rand(b, length, e, generator=g, dtype=dtype) * 0.5 + 0.05
    A = -torch.rand(e, n, generator=g, dtype=dtype) * 2 - 0.1
    B = torch.randn(b, length, n, generator=g, dtype=dtype)
    C = torch.randn(b, length, n, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (u, delta, A, B, C)]


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_mamba1_scan_backward_is_the_gradient_across_chunk_boundaries(chunk):
    """The recomputing backward equals autograd through the step-by-step recurrence (fp64)."""
    inputs = _scan_inputs()
    y, _ = ops.mamba1_scan(*inputs, chunk_size=chunk)
    assert y.grad_fn is not None and "Mamba1Scan" in type(y.grad_fn).__name__
    y_ref, _ = ops.mamba1_scan(*inputs, chunk_size=chunk, return_states=True)  # recorded steps
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-14)  # fp64: read-outs sum in other orders
    gy = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, gy)
    ref = torch.autograd.grad(y_ref, inputs, gy)
    for name, g, r in zip(("u", "delta", "A", "B", "C"), grads, ref, strict=True):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), name
    assert torch.autograd.gradcheck(
        lambda *a: ops.Mamba1Scan.apply(*a, chunk), inputs, eps=1e-6, atol=1e-8
    )


def _plain_recurrence(u, delta, A, B, C):
    """``y_t = C_t · h_t``, ``h_t = exp(Δ_t A) h_{t-1} + Δ_t u_t B_t``, one step at a time, fp64."""
    u, delta, A, B, C = (t.detach().double() for t in (u, delta, A, B, C))
    state = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=torch.float64)
    ys = []
    for t in range(u.shape[1]):
        write = (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        state = torch.exp(delta[:, t, :, None] * A) * state + write
        ys.append(torch.einsum("ben,bn->be", state, C[:, t]))
    return torch.stack(ys, 1)


@pytest.mark.parametrize("length", [1, 7, 12])
def test_mamba2_ssd_equals_the_recurrence_in_one_chunk_or_many(length):
    """One chunk (the input no longer than ``chunk_size``: no state carried in, steps 2-4 skipped)
    and several chunks both equal the step-by-step recurrence (fp64), and each other."""
    g = torch.Generator().manual_seed(length)
    b, h, p, grp, n = 2, 4, 3, 2, 5
    x = torch.randn(b, length, h, p, generator=g, dtype=torch.float64)
    dt = torch.rand(b, length, h, generator=g, dtype=torch.float64) * 0.5 + 0.05
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 2 - 0.1
    B, C = (torch.randn(b, length, grp, n, generator=g, dtype=torch.float64) for _ in range(2))
    states = ops.mamba2_recurrent(x, dt, A, B, C)  # [b, pos, head, d_head, state]
    ref = torch.einsum("blhpn,blhn->blhp", states, C.repeat_interleave(h // grp, dim=2))
    one = ops.mamba2_ssd(x, dt, A, B, C, chunk_size=64)
    many = ops.mamba2_ssd(x, dt, A, B, C, chunk_size=3)
    assert torch.allclose(one, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(many, ref, rtol=1e-12, atol=1e-12)


# float32 rows of [7 channels, 4 states] are 112 bytes: the whole batch, 1 row, 2 rows per tile
@pytest.mark.parametrize("tile_bytes", [2**20, 1, 224])
def test_mamba1_scan_equals_the_plain_recurrence_in_any_batch_tiles(monkeypatch, tile_bytes):
    """The fast scan (state [rows, state, channel] updated in place, batch tiles) gives the
    plain recurrence's outputs (fp32 vs fp64: ~1e-7 relative) and, through Mamba1Scan's
    backward from the states saved per tile, autograd's gradients through the recorded steps."""
    monkeypatch.setattr(ops, "SCAN_TILE_BYTES", tile_bytes)
    inputs = [t.detach().float() for t in _scan_inputs(seed=5, b=5, length=13, e=7, n=4)]
    ref = _plain_recurrence(*inputs)
    y, _ = ops.mamba1_scan(*inputs)
    assert y.is_contiguous() and y.dtype == torch.float32
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-5, f"fast scan vs plain recurrence: {rel:.2e} relative"
    wide = _scan_inputs(seed=5, b=5, length=13, e=7, n=4)  # fp64 leaves
    y64, _ = ops.mamba1_scan(*wide, chunk_size=4)
    ref64 = _plain_recurrence(*wide)
    assert (y64 - ref64).abs().max().item() <= 1e-12 * ref64.abs().max().item()
    gy = torch.randn_like(y64)
    grads = torch.autograd.grad(y64, wide, gy)
    ref_grads = torch.autograd.grad(ops.mamba1_scan(*wide, 4, return_states=True)[0], wide, gy)
    for name, g, r in zip(("u", "delta", "A", "B", "C"), grads, ref_grads, strict=True):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("rows", [None, [0, 5, 7, 8, 22], [22, 3, 3, 9], [15]])
def test_mamba1_pattern_equals_the_term_by_term_sum(rows):
    """The blocked pattern (rows after a key block factorized, rows inside it by the block's
    recurrence) equals the definition term by term, for any rows (unsorted, repeated, at block
    ends), with and without autograd (in place vs a copy per position), and its gradient is
    the definition's."""
    delta, A, B, C = _scan_inputs(seed=6, b=2, length=23, e=5, n=4)[1:]
    q = None if rows is None else torch.tensor(rows)
    direct = _plain_pattern(delta, A, B, C)
    direct = direct if q is None else direct[:, :, q]
    ref = direct.detach()
    with torch.no_grad():
        fast = ops.mamba1_pattern(delta, A, B, C, q, block_size=8)
        fast32 = ops.mamba1_pattern(*(t.float() for t in (delta, A, B, C)), q, block_size=8)
    assert (fast - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()
    assert (fast32.double() - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    recorded = ops.mamba1_pattern(delta, A, B, C, q, block_size=8)
    assert recorded.grad_fn is not None and torch.allclose(recorded, fast, rtol=0, atol=1e-14)
    w = torch.randn_like(recorded)
    grads = torch.autograd.grad((recorded * w).sum(), (delta, A, B, C))
    ref_grads = torch.autograd.grad((direct * w).sum(), (delta, A, B, C))
    for name, g, r in zip(("delta", "A", "B", "C"), grads, ref_grads, strict=True):
        assert torch.allclose(g, r, rtol=1e-9, atol=1e-12), name


def _plain_pattern(delta, A, B, C):
    """``α[b,e,i,j] = Σ_n C_in exp(A_en Σ_{k=j+1..i} Δ_k) Δ_j B_jn`` from the definition."""
    L = delta.shape[1]
    rows = []
    for i in range(L):
        S = torch.stack([delta[:, j + 1 : i + 1].sum(1) for j in range(L)], 1)  # [b, j, e]
        decay = torch.exp(S[..., None] * A)  # [b, j, e, n]
        row = (decay * C[:, i, None, None] * B[:, :, None]).sum(-1) * delta  # [b, j, e]
        rows.append(row * (torch.arange(L) <= i)[None, :, None])
    return torch.stack(rows, 2).permute(0, 3, 2, 1)  # [b, e, i, j]


def model_for(arch):
    from interventions_helpers import model

    return model(arch)


@functools.cache
def _mamba1_fp64():
    """Tiny Mamba-1 in float64 throughout (the residual stream too: no fp32 rounding hides a
    difference between the paths)."""
    from gna_lens.testing import tiny_hooked_ssm

    m = tiny_hooked_ssm("mamba1", vocab_size=len(tok()), residual_in_fp32=False)
    assert not m.cfg.residual_in_fp32
    return m.to(torch.float64)


def _grads(m, ids, met, idx, materialize):
    """∂metric/∂(hook_z and the scan's inputs u, Δ, B, C) of every layer, with or without the
    materialized pattern path."""
    view = head_view(m)
    leaves = {}

    def grab(z, hook):
        leaf = torch.zeros_like(z, requires_grad=True)
        leaves[hook.name] = leaf
        return z + leaf

    scan_in = ("hook_ssm_input", "hook_ssm_dt", "hook_ssm_B", "hook_ssm_C")
    hooks = [(lh.z_hook, grab) for lh in view]
    hooks += [(f"blocks.{lh.layer}.mixer.{name}", grab) for lh in view for name in scan_in]
    if materialize:
        hooks += [(lh.pattern_hook, lambda p, hook: p) for lh in view]
    with torch.enable_grad(), m.hooks(fwd_hooks=hooks):
        values = met(m(ids)[:, -1], idx)
        names = sorted(leaves)
        grads = torch.autograd.grad(values.sum(), [leaves[n] for n in names])
    return dict(zip(names, grads, strict=True))


def test_mamba1_attribution_on_the_fast_scan_matches_the_materialized_path(monkeypatch):
    """Must-show: in float64 (weights, mixers and residual; the RMSNorms compute in fp32 as HF
    does), the gradients w.r.t. every channel's hook_z and every scan input (u, Δ, B, C), and
    the attribution scores of every head, equal those through the materialized O(L^2) pattern
    within 1e-5 (measured: scan inputs ~2e-16, hook_z and scores 0); attribution no longer
    materializes anything."""
    m = _mamba1_fp64()
    t = make_task()
    met, ids, idx = Metric("logit_diff", t), tokens(t), torch.arange(len(t))
    fast = _grads(m, ids, met, idx, materialize=False)
    slow = _grads(m, ids, met, idx, materialize=True)
    assert fast.keys() == slow.keys() and len(fast) == 5 * m.cfg.n_layers
    for name in fast:
        assert fast[name].abs().max() > 0
        assert torch.allclose(fast[name], slow[name], rtol=0, atol=1e-5), name

    view = head_view(m)
    calls = []
    real = ops.mamba1_pattern
    monkeypatch.setattr(ops, "mamba1_pattern", lambda *a, **k: calls.append(1) or real(*a, **k))
    est = I.attribute_heads(m, t)
    assert not calls and "chunked autograd function" in est.info["paths"]["gradient"][0]
    with m.hooks(fwd_hooks=[(lh.pattern_hook, lambda p, hook: p) for lh in view]):
        ref = I.attribute_heads(m, t)  # every layer's pattern hooked: the materialized path
    assert calls  # the reference did take the materialized path
    assert est.cells == ref.cells and len(est.cells) == view.n_heads_total
    assert torch.allclose(est.values, ref.values, rtol=0, atol=1e-5)
    assert torch.allclose(est.baseline, ref.baseline, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- pattern scores
def _full_materialization_scores(m, t, heads, batch_size=4, padding_side="left"):
    """The pre-streaming pattern_scores: every layer's whole pattern ([batch, head, L, L], all
    rows) captured in one forward and held until every layer is scored."""
    from gna_lens.scoring.patterns import _capture_patterns, _sample_scores

    view = head_view(m)
    layers = sorted({layer for layer, _ in heads})
    per_layer = {layer: [] for layer in layers}
    bos = t.tokenizer.bos_token_id
    for batch in t.batches(batch_size, padding_side=padding_side):
        with torch.no_grad(), _capture_patterns(m, view, layers) as store:
            m(batch.input_ids, attention_mask=batch.attention_mask)
        for layer in layers:
            pat = store[layer].double()
            for b, (sample, off) in enumerate(zip(batch.samples, batch.offsets, strict=True)):
                n = sample.n_tokens
                sink = bos is not None and sample.input_ids[0] == bos
                P = pat[b, :, off : off + n, off : off + n]
                per_layer[layer].append(_sample_scores(P, sample, sink))
    stacked = {layer: torch.stack(rows) for layer, rows in per_layer.items()}
    return torch.stack([stacked[layer][:, h] for layer, h in heads], 1).float()


@functools.cache
def _fp64(arch):
    from gna_lens.testing import tiny_hooked_ssm

    return tiny_hooked_ssm(arch, vocab_size=len(tok())).to(torch.float64)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
@pytest.mark.parametrize("subset", [False, True])
def test_rows_only_streamed_pattern_scores_equal_full_materialization(arch, subset):
    """float64 models: rows-only, layer-by-layer scores equal the full-materialization scores
    (measured: bit-identical; 1e-6 allowed). In float32 the two differ by ~1e-5, because a
    materialized layer's output (pattern @ x for the materialized rows) rounds differently from
    the fast scan and later layers see that."""
    from gna_lens.scoring import pattern_scores

    m, t = _fp64(arch), make_task(n_pairs=4, n_samples=6)
    view = head_view(m)
    heads = [(0, 1), (0, 5), (view.n_layers - 1, 2)] if subset else view.heads()
    got = pattern_scores(m, t, heads=heads if subset else None, batch_size=4, progress=False)
    ref = _full_materialization_scores(m, t, heads)
    assert list(got.heads) == heads
    assert torch.equal(got.per_sample.isnan(), ref.isnan())
    assert torch.allclose(got.per_sample.nan_to_num(), ref.nan_to_num(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
def test_pattern_scores_materialize_only_scored_rows_and_one_layer_at_a_time(arch):
    """Memory: every SSM pattern pattern_scores materializes is [batch, heads, rows, L] with
    rows = the scored rows (summary tokens, their null shifts, the query), fewer than L; and when
    a layer's pattern is computed, no earlier layer's pattern of that forward is still alive."""
    import weakref

    from gna_lens.scoring import pattern_scores
    from gna_lens.scoring.patterns import scored_rows

    m = model_for(arch)
    t = make_task(n_pairs=4, n_samples=4)
    view = head_view(m)
    seen, alive_before = [], []

    def watch(pattern, hook):
        alive_before.append([r() is not None for r in seen])
        seen.append(weakref.ref(pattern))
        if view[int(hook.name.split(".")[1])].kind == "ssm":
            shapes.append(tuple(pattern.shape))

    shapes = []
    with m.hooks(fwd_hooks=[(lh.pattern_hook, watch) for lh in view]):
        pattern_scores(m, t, batch_size=len(t), progress=False)
    assert len(seen) == view.n_layers and not any(any(a) for a in alive_before)
    length = t[0].n_tokens
    rows = scored_rows(t[0])
    assert all(s.n_tokens == length and scored_rows(s) == rows for s in t)
    n_ssm = sum(lh.kind == "ssm" for lh in view)
    assert len(shapes) == n_ssm and len(rows) < length
    for shape in shapes:
        assert shape == (len(t), m.cfg.n_heads, len(rows), length)  # n_rows * L, not L^2
