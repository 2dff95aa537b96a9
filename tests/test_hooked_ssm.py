"""HookedSSM: parity with Hugging Face, the editable implicit attention, hooks and errors."""

import pytest
import torch
from transformer_lens import patching
from transformer_lens.model_protocol import TransformerLensModel

from gna_lens.errors import ConfigError, GnaLensError, HookError, PatternEditError
from gna_lens.models import HookedSSM, channel_groups, load_model
from gna_lens.testing import tiny_checkpoint, tiny_hf_model, tiny_hooked_ssm, tiny_tokenizer

SSM_ARCHS = ["mamba1", "falcon_mamba", "mamba2", "bamba"]
PATTERN = lambda name: name.endswith("hook_pattern")  # noqa: E731
IDENTITY = lambda t, hook: t  # noqa: E731
#: The README's claim: logits match Hugging Face's to a max abs difference below 1e-5 in fp32.
#: Measured on every PARITY_CASES model, length and path below: at most 4.9e-6.
PARITY_ATOL = 1e-5


def assert_matches_hf(ours, ref, what=""):
    """The parity check every test of this file (and tests/test_invariants_break.py) uses."""
    diff = (ours - ref).abs().max().item()
    assert diff < PARITY_ATOL, f"{what}: max abs logit difference {diff:.3g} >= {PARITY_ATOL}"


def _hf_reference(path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


# (arch, overrides): n_groups in {1, 2}; chunk sizes smaller than the sequence.
PARITY_CASES = [
    ("mamba1", {}),
    ("falcon_mamba", {}),
    ("mamba2", {"n_groups": 1}),
    ("mamba2", {"n_groups": 2, "chunk_size": 8}),
    ("mamba2", {"time_step_limit": (0.05, 0.6)}),
    ("bamba", {"mamba_n_groups": 1}),
    ("bamba", {"mamba_n_groups": 2, "mamba_chunk_size": 8}),
]


@pytest.fixture(scope="module", params=PARITY_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def loaded_pair(request, tmp_path_factory):
    """A checkpoint on disk loaded by HF and by HookedSSM.from_pretrained (the hub code path)."""
    arch, overrides = request.param
    path = tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=3, **overrides)
    return _hf_reference(path), HookedSSM.from_pretrained(str(path)), arch


@pytest.mark.parametrize("length", [1, 23, 40])
@pytest.mark.parametrize("path", ["fast", "materialized"])
def test_logits_match_hf(loaded_pair, length, path):
    hf, model, _ = loaded_pair
    tokens = torch.randint(2, 320, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf(tokens).logits
        hooks = [(PATTERN, IDENTITY)] if path == "materialized" else []
        out = model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert_matches_hf(out, ref, f"{path} path, length {length}")


def test_logits_match_hf_with_left_padding(loaded_pair):
    hf, model, _ = loaded_pair
    tokens = torch.randint(2, 320, (3, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0
    mask[1, :12] = 0
    tokens = tokens.masked_fill(mask == 0, 1)
    with torch.no_grad():
        ref = hf(tokens, attention_mask=mask).logits
        fast = model(tokens, attention_mask=mask)
        mat = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[(PATTERN, IDENTITY)])
        alone = model(tokens[1:2, 12:])
    real = mask.bool()
    assert_matches_hf(fast[real], ref[real], "fast path, left padding")
    assert_matches_hf(mat[real], ref[real], "materialized path, left padding")
    # A left-padded row gives the same logits as the unpadded prompt.
    assert_matches_hf(fast[1, 12:], alone[0], "left-padded row vs the prompt alone")


def test_text_batches_are_padded_and_masked():
    model = tiny_hooked_ssm("mamba2")
    texts = ["apple:12\nriver:47", "stone"]
    with torch.no_grad():
        batch = model(texts, padding_side="left")
        single = model(texts[1])
    assert (batch[1, -single.shape[1] :] - single[0]).abs().max().item() <= 1e-5


def _mixer_tensors(model, tokens, layer=0):
    names = [f"blocks.{layer}.mixer.{n}" for n in ("hook_ssm_input", "hook_ssm_out")]
    with torch.no_grad():
        _, fast = model.run_with_cache(tokens, names_filter=names)
        _, mat = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.mixer.hook_pattern")
    return fast[names[0]], fast[names[1]], mat[f"blocks.{layer}.mixer.hook_pattern"]


@pytest.mark.parametrize("length", [45, 150])
@pytest.mark.parametrize("arch", ["mamba1", "falcon_mamba", "mamba2"])
def test_pattern_reconstructs_mixer_and_is_causal(arch, length):
    model = tiny_hooked_ssm(arch, seed=1)
    tokens = torch.randint(2, 320, (2, length), generator=torch.Generator().manual_seed(1))
    x, ssm_out, pattern = _mixer_tensors(model, tokens)
    D = model.blocks[0].mixer.D.detach()
    if arch == "mamba2":
        recon = torch.einsum("bhij,bjhp->bihp", pattern, x) + x * D[:, None]
    else:
        recon = torch.einsum("beij,bje->bie", pattern, x) + x * D
    rel = (recon - ssm_out).norm() / ssm_out.norm()
    assert rel.item() < 1e-5
    assert pattern.triu(1).abs().max().item() == 0.0
    assert pattern.tril().abs().sum().item() > 0


def test_pattern_does_not_depend_on_chunk_size():
    tokens = torch.randint(2, 320, (1, 50), generator=torch.Generator().manual_seed(2))
    small = tiny_hooked_ssm("mamba2", seed=2, chunk_size=8)
    large = tiny_hooked_ssm("mamba2", seed=2, chunk_size=64)
    _xs, outs, ps = _mixer_tensors(small, tokens)
    _xl, outl, pl = _mixer_tensors(large, tokens)
    assert torch.equal(ps, pl)
    assert (outs - outl).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_long_pattern_is_finite(arch):
    model = tiny_hooked_ssm(arch, num_hidden_layers=1)
    tokens = torch.randint(2, 320, (1, 4096), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.pattern_selection(heads=[0, 5]):
        _, cache = model.run_with_cache(tokens, names_filter="blocks.0.mixer.hook_pattern")
    pattern = cache["blocks.0.mixer.hook_pattern"]
    assert pattern.shape == (1, 2, 4096, 4096)
    assert torch.isfinite(pattern).all()
    # The last row is what float64 gives: the decay over ~4000 steps is exactly computed (early
    # keys underflow to 0 in float64 too), with no inf * 0 = NaN from the long cumulative sums.
    wide = tiny_hooked_ssm(arch, num_hidden_layers=1).to(torch.float64)
    with torch.no_grad(), wide.pattern_selection(heads=[0, 5], query_positions="last"):
        _, cache64 = wide.run_with_cache(tokens, names_filter="blocks.0.mixer.hook_pattern")
    last = pattern[0, :, -1].double()
    exact = cache64["blocks.0.mixer.hook_pattern"][0, :, -1]
    assert (last - exact).abs().max().item() <= 1e-6 * exact.abs().max().item()
    assert (last != 0).sum().item() > 100  # the recent keys carry weight
    assert exact[last == 0].abs().max().item() < 1e-30  # zeros only where float64 is ~0 too


def test_pattern_selection_rows_and_heads_match_full_pattern():
    model = tiny_hooked_ssm("mamba2", seed=4)
    tokens = torch.randint(2, 320, (2, 30), generator=torch.Generator().manual_seed(4))
    name = "blocks.1.mixer.hook_pattern"
    with torch.no_grad():
        full_logits, full = model.run_with_cache(tokens, names_filter=name)
        with model.pattern_selection(heads={1: [2, 6]}, query_positions=[3, -1]):
            part_logits, part = model.run_with_cache(tokens, names_filter=name)
    expected = full[name][:, [2, 6]][:, :, [3, 29]]
    assert torch.allclose(part[name], expected, atol=1e-6)
    assert (part_logits - full_logits).abs().max().item() <= 1e-5


def largest_tensor(fn):
    """The element count of the largest tensor any op creates while ``fn()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    with Largest() as mode:
        fn()
    return mode.largest


def pattern_growth(model, length, **selection):
    """How much the largest tensor of a pattern forward grows when the prompt doubles."""

    def run(n):
        tokens = torch.randint(2, 320, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), model.pattern_selection(**selection):
            model.run_with_cache(tokens, names_filter="blocks.0.mixer.hook_pattern")

    return largest_tensor(lambda: run(2 * length)) / largest_tensor(lambda: run(length))


def assert_linear(growth):
    assert growth <= 2.2, f"the largest tensor grew {growth:.2f}x for 2x tokens (linear: 2x)"


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_single_row_pattern_memory_is_linear(arch):
    """The last query row of the implicit attention never builds a [pos, pos] tensor: every
    tensor the forward creates grows 2x for 2x tokens (the full pattern grows 4x)."""
    model = tiny_hooked_ssm(arch, num_hidden_layers=1)
    assert_linear(pattern_growth(model, 1024, query_positions="last"))
    full = pattern_growth(model, 256)  # the measurement tells quadratic from linear
    assert full >= 3.8
    with pytest.raises(AssertionError, match="grew"):
        assert_linear(full)


def _skip_write_reference_mamba2(x, dt, A, B, C, D, head, key):
    """y = C·h + D x from a recurrence that never writes position `key` of `head`."""
    b, L, H, P = x.shape
    Bh = B.repeat_interleave(H // B.shape[2], dim=2)
    Ch = C.repeat_interleave(H // C.shape[2], dim=2)
    state = torch.zeros(b, H, P, B.shape[-1])
    ys = []
    for t in range(L):
        write = (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        if t == key:
            write[:, head] = 0
        state = torch.exp(dt[:, t] * A)[..., None, None] * state + write
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(ys, 1) + x * D[:, None]


def _skip_write_reference_mamba1(u, delta, A, B, C, D, channel, key):
    b, L, E = u.shape
    state = torch.zeros(b, E, A.shape[-1])
    ys = []
    for t in range(L):
        write = delta[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        if t == key:
            write[:, channel] = 0
        state = torch.exp(delta[:, t, :, None] * A) * state + write
        ys.append(torch.einsum("ben,bn->be", state, C[:, t]))
    return torch.stack(ys, 1) + u * D


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "bamba"])
def test_zeroing_a_key_column_equals_skipping_that_write(arch):
    model = tiny_hooked_ssm(arch, seed=5)
    tokens = torch.randint(2, 320, (2, 20), generator=torch.Generator().manual_seed(5))
    layer, head, key = 0, 3, 6
    mixer = model.blocks[layer].mixer
    prefix = f"blocks.{layer}.mixer."

    def zero_column(pattern, hook):
        pattern[:, head, :, key] = 0.0
        return pattern

    saved = {}

    def save(t, hook):
        saved[hook.name.rsplit(".", 1)[-1]] = t

    def reference(ssm_out, hook):
        A = -torch.exp(mixer.A_log.detach().float())
        args = (
            saved["hook_ssm_input"],
            saved["hook_ssm_dt"],
            A,
            saved["hook_ssm_B"],
            saved["hook_ssm_C"],
        )
        fn = _skip_write_reference_mamba1 if arch == "mamba1" else _skip_write_reference_mamba2
        return fn(*args, mixer.D.detach(), head, key)

    with torch.no_grad():
        clean = model.run_with_hooks(tokens, fwd_hooks=[(prefix + "hook_pattern", IDENTITY)])
        edited = model.run_with_hooks(tokens, fwd_hooks=[(prefix + "hook_pattern", zero_column)])
        save_hooks = [
            (prefix + n, save)
            for n in ("hook_ssm_input", "hook_ssm_dt", "hook_ssm_B", "hook_ssm_C")
        ]
        ref = model.run_with_hooks(
            tokens, fwd_hooks=[*save_hooks, (prefix + "hook_ssm_out", reference)]
        )
    assert (edited - clean).abs().max().item() > 1e-3
    assert (edited[:, :key] - clean[:, :key]).abs().max().item() == 0.0
    assert (edited - ref).abs().max().item() <= 2e-5  # a sequential loop: measured <= 6.7e-6


@pytest.mark.parametrize("arch", SSM_ARCHS)
def test_head_ablation_through_hook_z_is_causal_and_weights_untouched(arch):
    model = tiny_hooked_ssm(arch, seed=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(2, 320, (1, 16), generator=torch.Generator().manual_seed(6))
    start = 7

    def ablate(z, hook):
        z[:, start:, 2] = 0.0
        return z

    with torch.no_grad():
        clean = model(tokens)
        hooked = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mixer.hook_z", ablate)])
    assert torch.equal(hooked[:, :start], clean[:, :start])
    assert (hooked[:, start] - clean[:, start]).abs().max().item() > 1e-4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_attention_layer_pattern_edit_changes_output():
    model = tiny_hooked_ssm("bamba", seed=7)
    tokens = torch.randint(2, 320, (1, 12), generator=torch.Generator().manual_seed(7))

    def keep_diagonal(pattern, hook):
        return torch.diag_embed(torch.ones_like(pattern[..., 0]))

    with torch.no_grad():
        clean = model(tokens)
        edited = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.1.attn.hook_pattern", keep_diagonal)]
        )
    assert (edited - clean).abs().max().item() > 1e-3


def test_no_hook_survives_an_exception_inside_a_hook():
    model = tiny_hooked_ssm("mamba2")
    model.add_hook("blocks.0.hook_resid_pre", IDENTITY, is_permanent=True)

    def boom(t, hook):
        raise RuntimeError("inside hook")

    with pytest.raises(RuntimeError, match="inside hook"):
        model.run_with_hooks(
            "a b", fwd_hooks=[(PATTERN, IDENTITY), ("blocks.1.mixer.hook_z", boom)]
        )
    with (
        pytest.raises(RuntimeError, match="inside hook"),
        model.hooks(fwd_hooks=[("hook_embed", boom)]),
    ):
        model("a b")
    remaining = {n: len(hp.fwd_hooks) for n, hp in model.hook_dict.items() if hp.fwd_hooks}
    assert remaining == {"blocks.0.hook_resid_pre": 1}  # the user's own permanent hook stays


def test_every_documented_hook_fires_with_its_shape():
    model = tiny_hooked_ssm("bamba")
    cfg = model.cfg
    tokens = torch.randint(2, 320, (2, 9))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    assert set(cache.keys()) == set(model.hook_dict)
    H, P, E = cfg.n_heads, cfg.d_head, cfg.d_inner
    assert cache["blocks.0.mixer.hook_pattern"].shape == (2, H, 9, 9)
    assert cache["blocks.0.mixer.hook_z"].shape == (2, 9, H, P)
    assert cache["blocks.0.mixer.hook_ssm_state"].shape == (2, 9, H, P, cfg.d_state)
    assert cache["blocks.0.mixer.hook_gate"].shape == (2, 9, E)
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, cfg.n_attn_heads, 9, 9)
    assert cache["blocks.1.attn.hook_z"].shape == (2, 9, cfg.n_attn_heads, cfg.attn_d_head)
    assert cache["blocks.1.attn.hook_k"].shape == (2, 9, cfg.n_attn_kv_heads, cfg.attn_d_head)
    m1 = tiny_hooked_ssm("mamba1")
    with torch.no_grad():
        _, c1 = m1.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mixer"))
    assert c1["blocks.0.mixer.hook_pattern"].shape == (2, m1.cfg.d_inner, 9, 9)
    assert c1["blocks.0.mixer.hook_z"].shape == (2, 9, m1.cfg.d_inner, 1)
    assert channel_groups(c1["blocks.0.mixer.hook_pattern"], 8).shape == (
        2,
        m1.cfg.d_inner // 8,
        9,
        9,
    )


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_ssm_state_hook_is_editable(arch):
    model = tiny_hooked_ssm(arch, seed=8)
    tokens = torch.randint(2, 320, (1, 10))

    def zero_states(states, hook):
        return torch.zeros_like(states)

    with torch.no_grad():
        clean = model(tokens)
        ident = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.0.mixer.hook_ssm_state", IDENTITY)]
        )
        zeroed = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.0.mixer.hook_ssm_state", zero_states)]
        )
    assert (ident - clean).abs().max().item() <= 1e-5
    assert (zeroed - clean).abs().max().item() > 1e-3


def test_transformer_lens_protocol_and_patching_helpers_run_unchanged():
    model = tiny_hooked_ssm("mamba2", seed=9)
    assert isinstance(model, TransformerLensModel)
    clean = torch.randint(2, 320, (1, 8), generator=torch.Generator().manual_seed(1))
    corrupt = clean.clone()
    corrupt[0, 2] = (clean[0, 2] + 1) % 320
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)

    def metric(logits):
        return (logits[0, -1] - clean_logits[0, -1]).abs().sum().neg()

    result = patching.get_act_patch_resid_pre(model, corrupt, clean_cache, metric)
    assert result.shape == (model.cfg.n_layers, 8)
    # Patching the clean residual stream at layer 0 everywhere a token differs restores the output.
    assert result[0, 2].item() == pytest.approx(0.0, abs=1e-4)
    assert result[0, 1].item() < -1e-3
    assert model.to_str_tokens("apple:12")[0] == "apple"
    assert model.to_string(model.to_tokens("river:47")[0]) == "river:47"


def test_start_and_stop_at_layer_compose():
    model = tiny_hooked_ssm("bamba", seed=10)
    tokens = torch.randint(2, 320, (2, 11))
    with torch.no_grad():
        full = model(tokens)
        resid = model(tokens, stop_at_layer=1)
        rest = model(resid, start_at_layer=1)
    assert torch.equal(full, rest)


def test_loss_matches_hf():
    hf = tiny_hf_model("mamba2", seed=11)
    model = HookedSSM.from_hf_model(hf, tiny_tokenizer())
    tokens = torch.randint(2, 320, (2, 13))
    with torch.no_grad():
        ref = hf(tokens, labels=tokens).loss
        loss = model(tokens, return_type="loss")
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)


# ---------------------------------------------------------------- bad input


def test_unknown_architecture_is_refused(tmp_path):
    path = tiny_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"model_type='llama'.*TransformerBridge"):
        HookedSSM.from_pretrained(str(path))
    with pytest.raises(ConfigError, match="no such folder"):
        load_model(tmp_path / "missing")


def test_load_model_dispatches_on_architecture(tmp_path):
    ssm = load_model(tiny_checkpoint("mamba1", tmp_path / "m1"))
    assert isinstance(ssm, HookedSSM)
    bridge = load_model(tiny_checkpoint("llama", tmp_path / "llama"))
    assert type(bridge).__name__ == "TransformerBridge"


def test_unknown_hook_name_is_refused_with_suggestion():
    model = tiny_hooked_ssm("mamba2")
    with pytest.raises(HookError, match=r"'blocks\.0\.mixer\.hook_patern'.*hook_pattern"):
        model.run_with_hooks("a", fwd_hooks=[("blocks.0.mixer.hook_patern", IDENTITY)])
    with pytest.raises(HookError, match=r"blocks\.9\.hook_resid_pre"):
        model.run_with_cache("a", names_filter=["blocks.9.hook_resid_pre"])
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_pattern_edit_with_wrong_shape_is_refused(arch):
    model = tiny_hooked_ssm(arch)
    name = "blocks.1.attn.hook_pattern" if arch == "bamba" else "blocks.0.mixer.hook_pattern"
    with pytest.raises(PatternEditError, match=r"shape \(1, 2, 3\).*expected \(1, \d+, 4, 4\)"):
        model.run_with_hooks(
            torch.arange(2, 6)[None], fwd_hooks=[(name, lambda t, hook: t[:, :2, :3, 0])]
        )


def test_low_precision_pattern_path_is_refused():
    model = tiny_hooked_ssm("mamba2").to(torch.bfloat16)
    with pytest.raises(PatternEditError, match=r"bfloat16.*model\.to\(torch\.float32\)"):
        model.run_with_hooks("a b", fwd_hooks=[(PATTERN, IDENTITY)])
    assert isinstance(PatternEditError("x"), GnaLensError)


def test_bad_forward_inputs_are_explained():
    model = tiny_hooked_ssm("mamba2")
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\)"):
        model(torch.arange(2, 6)[None], attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="start_at_layer"):
        model(torch.randn(1, 4, model.cfg.d_model))
    with pytest.raises(ValueError, match="out of range"), model.pattern_selection(heads=[99]):
        pass


@pytest.mark.parametrize("arch", ["mamba1", "falcon_mamba", "mamba2"])
def test_gradients_match_hf_on_the_fast_path(arch):
    hf = tiny_hf_model(arch, seed=12)
    model = HookedSSM.from_hf_model(hf, tiny_tokenizer())
    tokens = torch.randint(2, 320, (2, 19), generator=torch.Generator().manual_seed(12))
    hf(tokens, labels=tokens).loss.backward()
    model(tokens, return_type="loss").backward()
    ours = model.blocks[0].mixer.in_proj.weight.grad
    ref = hf.get_submodule("backbone.layers.0.mixer.in_proj").weight.grad
    assert ours is not None and (ours - ref).abs().max().item() <= 1e-5
