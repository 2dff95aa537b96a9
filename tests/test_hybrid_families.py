"""The hybrid families of issue 19 in HookedSSM: the contract every family must meet.

Per family, on tiny random configs mixing SSM, attention and MLP layers: logits and gradients
match Hugging Face's (fp32, lengths across chunk boundaries, left padding, n_groups 1 and 2
where the family has groups);
``pattern @ x + D x`` reconstructs each SSM layer's output; an edited pattern gives the output
recomputed independently through the edited matrix; a batched ablation sweep equals a loop of
single ablations; no hook remains after calls and errors.
"""

import dataclasses

import pytest
import torch
from interventions_helpers import hook_count, model, other_key, tok, tokens
from interventions_helpers import task as make_task
from numerics import fp32_tolerance

import gna_lens.interventions as I
from gna_lens.errors import InterventionError
from gna_lens.heads import head_view
from gna_lens.models import HookedSSM, load_model
from gna_lens.models.hooked_ssm import _convert_hf_state_dict
from gna_lens.testing import tiny_checkpoint, tiny_hf_model, tiny_tokenizer

PATTERN = lambda name: name.endswith("hook_pattern")  # noqa: E731
IDENTITY = lambda t, hook: t  # noqa: E731
#: The issue's bar; measured below 5e-6 on the Mamba-2 hybrids but Zamba2 (3e-5: its tiny random
#: model amplifies rounding, HF's own logits move by ~3e-5 under half-ulp input noise), and below
#: 1e-5 on Jamba (whose five layers' fp32 rounding puts HF's logits 2e-5 from fp64 at 300 tokens,
#: and ours as far).
PARITY_ATOL = 1e-4

# (family, overrides): n_groups 1 and 2, chunks shorter than the sequences.
CASES = [
    ("nemotron_h", {"n_groups": 1}),
    ("nemotron_h", {"n_groups": 2, "chunk_size": 8}),
    ("granitemoehybrid", {"mamba_n_groups": 1}),
    ("granitemoehybrid", {"mamba_n_groups": 2, "mamba_chunk_size": 8}),
    ("granitemoehybrid", {"num_local_experts": 0, "position_embedding_type": None}),
    ("falcon_h1", {"mamba_n_groups": 1}),
    ("falcon_h1", {"mamba_n_groups": 2, "mamba_chunk_size": 8}),
    ("falcon_h1", {"mamba_rms_norm": False}),
    ("falcon_h1", {"mamba_norm_before_gate": True, "mamba_chunk_size": 8}),
    # Zamba2: two shared blocks over three invocations, adapters, RoPE; one shared block, no
    # attention adapters, grouped-query attention without RoPE, SiLU.
    ("zamba2", {"mamba_ngroups": 2}),
    ("zamba2", {"mamba_ngroups": 1, "chunk_size": 8, "num_mem_blocks": 1}),
    (
        "zamba2",
        {
            "use_shared_attention_adapter": False,
            "num_key_value_heads": 2,
            "use_mem_rope": False,
            "hidden_act": "silu",
            "chunk_size": 8,
        },
    ),
    ("jamba", {}),  # attention and MoE layers at their periods / offsets
    ("jamba", {"num_experts": 1, "attn_layer_offset": 0, "num_key_value_heads": 4}),
]
#: The Hugging Face config's chunk size; None: a Mamba-1 family, whose chunks are HookedSSM's
#: own (``cfg.chunk_size``, the backward's recomputation chunks).
CHUNK = {
    "nemotron_h": "chunk_size",
    "granitemoehybrid": "mamba_chunk_size",
    "falcon_h1": "mamba_chunk_size",
    "zamba2": "chunk_size",
    "jamba": None,
}
FAMILIES = sorted({f for f, _ in CASES})


def _pair(family, overrides, seed=3, chunk=None):
    key = CHUNK[family]
    if chunk is not None and key is not None:
        overrides = {**overrides, key: chunk}
    hf = tiny_hf_model(family, seed=seed, **overrides)
    hf.config._attn_implementation = "eager"
    m = HookedSSM.from_hf_model(hf, tiny_tokenizer())
    if chunk is not None and key is None:
        m.cfg.chunk_size = chunk
    return hf, m


def _per_head(t):
    """Mamba-1's ``[batch, pos, d_inner]`` as ``[batch, pos, head=channel, d_head=1]``."""
    return t[..., None] if t.ndim == 3 else t


def _ids(b, length, seed=0):
    return torch.randint(2, 320, (b, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_logits_match_hf_fast_materialized_and_left_padded(case):
    hf, m = _pair(*case)
    with torch.no_grad():
        for length in (1, 23, 40):
            ids = _ids(2, length, length)
            ref = hf(ids).logits
            fast = m(ids)
            mat = m.run_with_hooks(ids, fwd_hooks=[(PATTERN, IDENTITY)])
            assert (fast - ref).abs().max().item() < PARITY_ATOL, length
            assert (mat - ref).abs().max().item() < PARITY_ATOL, length
        ids = _ids(3, 21)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        mask[1, :12] = 0
        ids = ids.masked_fill(mask == 0, 1)
        ref = hf(ids, attention_mask=mask).logits
        fast = m(ids, attention_mask=mask)
        mat = m.run_with_hooks(ids, attention_mask=mask, fwd_hooks=[(PATTERN, IDENTITY)])
        alone = m(ids[1:2, 12:])
    real = mask.bool()
    assert (fast[real] - ref[real]).abs().max().item() < PARITY_ATOL
    assert (mat[real] - ref[real]).abs().max().item() < PARITY_ATOL
    assert (fast[1, 12:] - alone[0]).abs().max().item() < PARITY_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_hf(family):
    hf, m = _pair(family, {}, chunk=8)
    ids = _ids(2, 19, 4)
    # A mean-scaled loss (sum(logits * w) / numel): gradients of order 1e-2, so 1e-5 is a bar
    # fp32 can meet (with a plain sum they are ~1e2 and one float ulp is already ~1e-5).
    weight = torch.randn(2, 19, 320, generator=torch.Generator().manual_seed(1)) / (2 * 19 * 320)
    (hf(ids).logits * weight).sum().backward()
    (m(ids) * weight).sum().backward()
    ref = _convert_hf_state_dict(
        m.cfg, {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    )
    ours = dict(m.named_parameters(remove_duplicate=False))  # tied weights under each name
    assert ref, "HF produced no gradients"
    for name, g in ref.items():
        got = ours[name].grad
        assert got is not None, name
        diff = (got - g).abs().max().item()
        assert diff < 1e-5 and diff <= 1e-4 * g.abs().max().item() + 1e-9, (name, diff)


@pytest.mark.parametrize("family", FAMILIES)
def test_pattern_reconstructs_every_ssm_layer_and_edits_take_effect(family):
    _, m = _pair(family, {}, seed=1, chunk=8)
    ids = _ids(2, 30, 1)
    ssm_layers = list(m.ssm_mixers())
    assert ssm_layers
    for layer in ssm_layers:
        pre = f"blocks.{layer}.mixer."
        names = [pre + "hook_ssm_input", pre + "hook_ssm_out", pre + "hook_pattern"]
        with torch.no_grad():
            _, fast = m.run_with_cache(ids, names_filter=names[:2])
            _, mat = m.run_with_cache(ids, names_filter=names[2])
        x, out, pattern = _per_head(fast[names[0]]), _per_head(fast[names[1]]), mat[names[2]]
        D = m.blocks[layer].mixer.D.detach()
        recon = torch.einsum("bhij,bjhp->bihp", pattern, x) + x * D[:, None]
        assert ((recon - out).norm() / out.norm()).item() < 1e-5, layer
        assert pattern.triu(1).abs().max().item() == 0.0

        # An edit (head 3 reads only its own position's key) gives exactly the output
        # recomputed through the edited matrix.
        def edit(p, hook):
            p[:, 3] = torch.diag_embed(torch.diagonal(p[:, 3], dim1=-2, dim2=-1))
            return p

        seen = {}

        def grab(t, hook, seen=seen):
            seen[hook.name] = t

        with torch.no_grad():
            clean = m(ids)
            edited = m.run_with_hooks(
                ids, fwd_hooks=[(pre + "hook_pattern", edit), (pre + "hook_ssm_out", grab)]
            )
        expected = edit(pattern.clone(), None)
        recon = torch.einsum("bhij,bjhp->bihp", expected, x) + x * D[:, None]
        assert (_per_head(seen[pre + "hook_ssm_out"]) - recon).abs().max().item() < 1e-5
        assert (edited - clean).abs().max().item() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode,positions", [("zero", None), ("mean", "last")])
def test_batched_sweep_equals_loop_and_leaves_no_hook(family, mode, positions):
    m = model(family)
    t = make_task()
    ref = None if mode == "zero" else make_task(seed=5)
    before = hook_count(m)
    res = I.ablation_sweep(
        m, t, "logit_diff", mode=mode, positions=positions, reference=ref, pack=5, progress=False
    )
    ids = tokens(t)
    idx = torch.arange(len(t))
    loop = []
    from gna_lens.interventions.metrics import Metric

    met = Metric("logit_diff", t)
    with torch.no_grad():
        for head in head_view(m).heads():
            with I.ablate_heads(m, [head], mode=mode, positions=positions, reference=ref):
                loop.append(met(m(ids)[:, -1], idx))
    assert (res.values - torch.stack(loop)).abs().max().item() <= 1e-5
    assert res.effects.abs().max() > 1e-3
    if positions == "last":
        assert res.method == "incremental", res.info
    assert hook_count(m) == before


@pytest.mark.parametrize("family", FAMILIES)
def test_no_hook_survives_an_exception(family):
    _, m = _pair(family, {})

    def boom(t, hook):
        raise RuntimeError("inside hook")

    layer = next(iter(m.ssm_mixers()))
    with pytest.raises(RuntimeError, match="inside hook"):
        m.run_with_hooks(
            _ids(1, 6), fwd_hooks=[(PATTERN, IDENTITY), (f"blocks.{layer}.mixer.hook_z", boom)]
        )
    assert not any(hp.fwd_hooks or hp.bwd_hooks for hp in m.hook_dict.values())


def test_nemotron_h_layer_kinds_and_heads():
    _, m = _pair("nemotron_h", {})
    assert m.cfg.layer_types == ["ssm", "attention", "mlp", "ssm", "mlp"]
    view = head_view(m)
    assert [None if lh is None else (lh.kind, lh.n_heads) for lh in view.layers] == [
        ("ssm", 8),
        ("attention", 4),
        None,
        ("ssm", 8),
        None,
    ]
    assert "blocks.2.mlp.hook_post" in m.hook_dict
    assert "blocks.4.mlp.hook_expert_weights" in m.hook_dict
    assert "blocks.1.attn.hook_pattern" in m.hook_dict


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_routes_the_family(family, tmp_path):
    path = tiny_checkpoint(family, tmp_path / family, seed=2)
    loaded = load_model(str(path))
    assert isinstance(loaded, HookedSSM)
    assert loaded.cfg.architecture == family


def test_granite_layer_kinds_multipliers_and_heads():
    _, m = _pair("granitemoehybrid", {})
    cfg = m.cfg
    assert cfg.layer_types == ["ssm", "attention", "ssm"]
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (3, 0.5, 2)
    assert m.blocks[1].attn.scale == pytest.approx(0.2)
    view = head_view(m)
    assert [(lh.kind, lh.n_heads) for lh in view] == [("ssm", 8), ("attention", 4), ("ssm", 8)]
    for name in (
        "blocks.0.mlp.shared_mlp.hook_post",
        "blocks.2.mlp.block_sparse_moe.hook_expert_weights",
    ):
        assert name in m.hook_dict
    # head_output_weights includes the residual multiplier: out_hook == z @ W_O.
    from gna_lens.heads import head_output_weights

    ids = _ids(1, 9)
    with torch.no_grad():
        for layer, (z_name, out_name) in enumerate(
            [("mixer.hook_z", "hook_mixer_out"), ("attn.hook_z", "hook_attn_out")]
        ):
            _, cache = m.run_with_cache(
                ids, names_filter=[f"blocks.{layer}.{z_name}", f"blocks.{layer}.{out_name}"]
            )
            w = head_output_weights(m, layer)
            out = torch.einsum("bphd,hdm->bpm", cache[f"blocks.{layer}.{z_name}"], w)
            assert (out - cache[f"blocks.{layer}.{out_name}"]).abs().max().item() < 1e-5


def test_falcon_h1_parallel_attention_multipliers_and_heads():
    _, m = _pair("falcon_h1", {})
    cfg = m.cfg
    assert cfg.layer_types == ["ssm"] * 3 and cfg.parallel_attention
    assert (cfg.embedding_multiplier, cfg.logits_scaling) == (2.0, 2.0)
    assert cfg.ssm_multipliers == (0.9, 1.1, 1.2, 0.8, 1.3)
    view = head_view(m)
    assert [(lh.kind, lh.n_heads) for lh in view] == [("mixed", 12)] * 3
    for name in ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_z", "blocks.0.hook_attn_out"):
        assert name in m.hook_dict
    ids = _ids(1, 9)
    # hook_mixer_out == z @ W_O (head_output_weights includes ssm_out_multiplier; part 0 is
    # the SSM heads, part 1 the attention's, with attention_out_multiplier), and the layer adds
    # both parallel outputs to the residual stream.
    from gna_lens.heads import head_output_weights

    names = [f"blocks.1.{n}" for n in ("mixer.hook_z", "hook_mixer_out", "hook_attn_out")]
    names += ["blocks.1.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_z"]
    with torch.no_grad():
        _, cache = m.run_with_cache(ids, names_filter=names)
    out = torch.einsum("bphd,hdm->bpm", cache[names[0]], head_output_weights(m, 1, part=0))
    assert (out - cache[names[1]]).abs().max().item() < 1e-5
    attn = torch.einsum("bphd,hdm->bpm", cache[names[5]], head_output_weights(m, 1, part=1))
    assert (attn - cache[names[2]]).abs().max().item() < 1e-5
    total = cache[names[3]] + cache[names[1]] + cache[names[2]]
    assert (total - cache[names[4]]).abs().max().item() < 1e-5

    # An edit of the parallel attention's pattern takes effect.
    def first_key(p, hook):
        p.zero_()
        p[..., 0] = 1.0
        return p

    with torch.no_grad():
        clean = m(ids)
        edited = m.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_pattern", first_key)])
    assert (edited - clean).abs().max().item() > 1e-4


def test_jamba_layer_kinds_moe_placement_and_heads():
    from gna_lens.models.mixers.mlp import GatedMLP, JambaMoE

    _, m = _pair("jamba", {})
    # attn_layer_period 3 / offset 1, expert_layer_period 2 / offset 1, 5 layers.
    assert m.cfg.layer_types == ["ssm", "attention", "ssm", "ssm", "attention"]
    assert [type(b.mlp) for b in m.blocks] == [GatedMLP, JambaMoE, GatedMLP, JambaMoE, GatedMLP]
    assert not m._uses_rope  # Jamba's attention has no positional rotation
    view = head_view(m)
    E = m.cfg.d_inner
    assert [(lh.kind, lh.n_heads, lh.d_head) for lh in view] == [
        ("ssm", E, 1),
        ("attention", 4, 8),
        ("ssm", E, 1),
        ("ssm", E, 1),
        ("attention", 4, 8),
    ]
    assert m.channel_heads
    for name in (
        "blocks.0.mixer.hook_pattern",
        "blocks.1.attn.hook_pattern",
        "blocks.1.mlp.hook_expert_weights",
        "blocks.3.mlp.hook_expert_weights",
        "blocks.4.mlp.hook_post",
    ):
        assert name in m.hook_dict, name
    _, dense = _pair("jamba", {"num_experts": 1})
    assert {type(b.mlp) for b in dense.blocks} == {GatedMLP}


def test_jamba_channel_groups_beside_attention_heads():
    """Channel groups on the Mamba-1 layers of a hybrid: the attention layers keep their heads,
    a grouped sweep (incremental last-position path) equals a loop of group ablations, and
    set_head_groups refuses an attention layer."""
    from gna_lens.errors import InterventionError
    from gna_lens.interventions.metrics import Metric

    m, t = model("jamba"), make_task()
    with m.head_groups(16):
        view = head_view(m)
        kinds = [(lh.kind, lh.n_heads) for lh in view]
        assert kinds == [("ssm", 4), ("attention", 4), ("ssm", 4), ("ssm", 4), ("attention", 4)]
        sweep = I.ablation_sweep(m, t, "logit_diff", positions="last", progress=False)
        assert sweep.method == "incremental", sweep.info
        met, ids, idx = Metric("logit_diff", t), tokens(t), torch.arange(len(t))
        with torch.no_grad():
            loop = []
            for (head,) in sweep.cells:
                with I.ablate_heads(m, [head], positions="last"):
                    loop.append(met(m(ids)[:, -1], idx))
    assert (sweep.values - torch.stack(loop)).abs().max().item() <= 1e-5
    with pytest.raises(InterventionError, match=r"layer 1 is not an SSM layer.*\[0, 2, 3\]"):
        m.set_head_groups({1: 8})
    assert m.head_group_spec == {} and hook_count(m) == 0


def test_scan_groups_a_large_jamba_by_default(tmp_path, monkeypatch):
    """Above EXACT_ALL_MAX (300) heads, ``gna-lens scan`` ranks blocks of 64 channels of the
    Mamba-1 layers, as on Mamba-1, beside the attention heads as they are, and writes the report."""
    import json

    from interventions_helpers import tok

    from gna_lens import scan as scan_module
    from gna_lens.testing import tiny_hooked_ssm

    m = tiny_hooked_ssm("jamba", vocab_size=len(tok()), mamba_expand=4)  # 3 x 128 channels
    assert head_view(m).n_heads_total > 300

    def tasks(tok_, task, n_samples, seed, n_eval=8, **kv):
        held_out = {"kv-4": make_task(n_pairs=4, n_samples=n_eval, seed=seed + 1)}
        return scan_module.ScanTasks(make_task(n_pairs=4, n_samples=n_samples), held_out)

    monkeypatch.setattr(scan_module, "build_tasks", tasks)
    result = scan_module.scan(
        m, n_samples=4, n_eval=4, top=2, out=tmp_path, control=None, random_draws=1,
        progress=False, force=True,
    )  # fmt: skip
    data = json.loads(result.json_path.read_text())
    assert data["layer_heads"] == [2, 4, 2, 2, 4] and data["method"]["head_group_size"] == 64
    assert data["method"]["head_groups"].endswith("every SSM layer (3): 2 blocks of 64 channels")
    assert "CircuitsVis" in result.html_path.read_text()
    assert m.head_group_spec == {} and hook_count(m) == 0


def test_zamba2_shared_block_invocations_are_distinct_heads_and_edits_stay_local():
    """The shared transformer block runs at layers 1, 3 and 4 (weights of shared block 0 at 1
    and 4): one set of parameters, but every invocation has its own hooks and adapters, its
    heads are distinct (layer, head) entries, and an ablation at one invocation leaves the
    others' computation as it is. No weight changes."""
    _, m = _pair("zamba2", {})
    b1, b3, b4 = (m.blocks[i] for i in (1, 3, 4))
    assert b1.attn.q_proj.weight is b4.attn.q_proj.weight  # shared block 0
    assert b1.mlp.down_proj.weight is b4.mlp.down_proj.weight
    assert b3.attn.q_proj.weight is not b1.attn.q_proj.weight  # shared block 1
    assert b1.attn.q_proj.adapter[0].weight is not b4.attn.q_proj.adapter[0].weight
    assert not torch.equal(b1.shared_proj.weight, b4.shared_proj.weight)
    view = head_view(m)
    assert [(lh.layer, lh.kind) for lh in view] == [
        (0, "ssm"),
        (1, "mixed"),
        (2, "ssm"),
        (3, "mixed"),
        (4, "mixed"),
    ]
    assert len({view[i].parts[0].z_hook for i in (1, 3, 4)}) == 3
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    ids = _ids(2, 17, 5)
    names = [f"blocks.{i}.{n}" for i in (1, 4) for n in ("hook_resid_pre", "hook_shared_out")]
    with torch.no_grad():
        clean, cache = m.run_with_cache(ids, names_filter=names)
        # Ablating a head of the invocation at layer 4 leaves the one at layer 1 as it was.
        with I.ablate_heads(m, [(4, 0)], mode="zero"):
            out4, abl4 = m.run_with_cache(ids, names_filter=names)
        assert torch.equal(abl4["blocks.1.hook_shared_out"], cache["blocks.1.hook_shared_out"])
        assert (
            abl4["blocks.4.hook_shared_out"] - cache["blocks.4.hook_shared_out"]
        ).abs().max() > 1e-3
        assert (out4 - clean).abs().max() > 1e-3
        # Ablating one at layer 1: layer 4's invocation computes what an unhooked block does on
        # the residual it receives.
        with I.ablate_heads(m, [(1, 2)], mode="zero"):
            _, abl1 = m.run_with_cache(ids, names_filter=names)
        assert (
            abl1["blocks.1.hook_shared_out"] - cache["blocks.1.hook_shared_out"]
        ).abs().max() > 1e-3
        _, again = m.run_with_cache(
            abl1["blocks.4.hook_resid_pre"], start_at_layer=4, tokens=ids, names_filter=names[3]
        )
        assert torch.equal(again["blocks.4.hook_shared_out"], abl1["blocks.4.hook_shared_out"])
        # Starting mid-way needs the rows' tokens (the shared blocks read the embeddings).
        resid = cache["blocks.1.hook_resid_pre"]
        assert (m(resid, start_at_layer=1, tokens=ids) - clean).abs().max() < 1e-5
        with pytest.raises(ValueError, match="token embeddings"):
            m(resid, start_at_layer=1)
    assert all(torch.equal(v, weights[k]) for k, v in m.state_dict().items())
    # A sweep over every head (incremental steps through the shared blocks) changes no weight.
    tiny = model("zamba2")
    weights = {k: v.clone() for k, v in tiny.state_dict().items()}
    res = I.ablation_sweep(tiny, make_task(), "logit_diff", positions="last", progress=False)
    assert res.method == "incremental" and len(res.values) == head_view(tiny).n_heads_total
    assert all(torch.equal(v, weights[k]) for k, v in tiny.state_dict().items())
    assert not any(hp.fwd_hooks or hp.bwd_hooks for hp in tiny.hook_dict.values())


def test_zamba2_biases_match_hf():
    """``add_bias_linear``: the mixers' projections and the shared MLP have biases."""
    hf = tiny_hf_model("zamba2", seed=4, add_bias_linear=True, num_mem_blocks=1)
    hf.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    m = HookedSSM.from_hf_model(hf, tiny_tokenizer())
    assert m.blocks[0].mixer.in_proj.bias is not None and m.blocks[1].mlp.down_proj.bias is not None
    ids = _ids(2, 21, 6)
    with torch.no_grad():
        assert (m(ids) - hf(ids).logits).abs().max().item() < PARITY_ATOL


# ----------------------------------------------------------------------------- multi-part layers
#: The families whose layers hold heads behind two sets of hooks, and the order of the parts:
#: Falcon-H1's SSM heads then its parallel attention's; Zamba2's shared-block attention heads
#: (they run first) then the hybrid layer's Mamba-2 heads.
MULTIPART = {"falcon_h1": ("ssm", "attention"), "zamba2": ("attention", "ssm")}


def _two_part_layer(view):
    return next(lh.layer for lh in view if len(lh.parts) == 2)


def _both(view, layer):
    """An attention head and an SSM head of ``layer`` (the layer's indices): each part's head
    1 and 3 (not its first, so an offset mistake shows)."""
    by_kind = {p.kind: p for p in view[layer].parts}
    return (layer, by_kind["attention"].offset + 1), (layer, by_kind["ssm"].offset + 3)


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_two_part_layers_list_both_kinds_with_their_counts_and_hooks(family):
    """Every SSM mixer's heads and every attention's heads are (layer, head) entries, numbered
    part after part, each part naming its own hooks."""
    m = model(family)
    cfg, view = m.cfg, head_view(m)
    n = {"attention": cfg.n_attn_heads, "ssm": cfg.n_heads}
    pre = {"attention": "attn.", "ssm": "mixer."}
    out = {"attention": "hook_attn_out", "ssm": "hook_mixer_out"}
    with_attn = [i for i, b in enumerate(m.blocks) if hasattr(b, "attn")]
    assert len(view.heads("ssm")) == n["ssm"] * len(m.ssm_mixers())
    assert len(view.heads("attention")) == n["attention"] * len(with_attn)
    two = [lh.layer for lh in view if len(lh.parts) == 2]
    assert two == (with_attn if family == "falcon_h1" else [1, 3, 4])
    for layer in two:
        lh = view[layer]
        first, second = MULTIPART[family]
        assert (lh.kind, lh.n_heads) == ("mixed", n[first] + n[second])
        assert [lh.kind_of(h) for h in range(lh.n_heads)] == [first] * n[first] + [second] * n[
            second
        ]
        for part, kind, offset in zip(lh.parts, (first, second), (0, n[first]), strict=True):
            p = f"blocks.{layer}.{pre[kind]}"
            assert (part.layer, part.kind, part.offset, part.n_heads) == (
                layer,
                kind,
                offset,
                n[kind],
            )
            assert (part.pattern_hook, part.z_hook) == (p + "hook_pattern", p + "hook_z")
            assert part.scores_hook == (p + "hook_attn_scores" if kind == "attention" else None)
            assert part.out_hook == f"blocks.{layer}.{out[kind]}"
            assert part.ssm_mixer == (kind == "ssm")
            assert part.resid_pre_hook == f"blocks.{layer}.hook_resid_pre"


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_ablating_an_attention_or_an_ssm_head_of_one_layer_zeroes_its_slice_only(family):
    """ablate_heads on either part's head == a hand-written hook zeroing that slice of that
    part's hook_z; the head's neighbours in the hook are untouched, and so is the other part
    where it does not read the edited one (parallel in Falcon-H1; upstream in Zamba2)."""
    m = model(family)
    view = head_view(m)
    layer = _two_part_layer(view)
    ids = tokens(make_task())[:2]
    names = [p.z_hook for p in view[layer].parts]
    for head in _both(view, layer):
        part, i = view.part_of(head)
        (other,) = [p for p in view[layer].parts if p is not part]

        def zero(z, hook, i=i):
            z = z.clone()
            z[:, :, i] = 0.0
            return z

        with torch.no_grad():
            clean, before = m.run_with_cache(ids, names_filter=names)
            with I.ablate_heads(m, [head]):
                ablated, after = m.run_with_cache(ids, names_filter=names)
            by_hand = m.run_with_hooks(ids, fwd_hooks=[(part.z_hook, zero)])
        assert torch.equal(ablated, by_hand), head
        assert (ablated - clean).abs().max().item() > 1e-4, head
        z, z0 = after[part.z_hook], before[part.z_hook]
        assert (z[:, :, i] == 0).all()
        keep = [j for j in range(part.n_heads) if j != i]
        assert torch.equal(z[:, :, keep], z0[:, :, keep])
        untouched = family == "falcon_h1" or other.offset < part.offset
        assert torch.equal(after[other.z_hook], before[other.z_hook]) == untouched, head
    assert hook_count(m) == 0


SWEEP_CASES = [("zero", None, "packed"), ("mean", None, "packed"), ("zero", None, "expand")]
SWEEP_CASES += [("mean", None, "expand"), ("zero", "last", None), ("mean", "last", None)]


@pytest.mark.parametrize("family", sorted(MULTIPART))
@pytest.mark.parametrize("mode,positions,strategy", SWEEP_CASES)
def test_sweep_over_both_parts_equals_a_loop_of_single_ablations(family, mode, positions, strategy):
    """Every head of a two-part layer, sets spanning both parts and another layer: the batched
    sweep (packed, or expanded at each part's output, or incremental from the prefix state)
    equals a loop of ablate_heads."""
    from gna_lens.interventions import engine as _engine
    from gna_lens.interventions.metrics import Metric
    from gna_lens.testing import tiny_hooked_ssm

    m = tiny_hooked_ssm(family, vocab_size=len(tok()))  # its own strategy verdicts
    if strategy is not None:
        _engine._STRATEGY[m] = {False: strategy}
    view = head_view(m)
    layer = _two_part_layer(view)
    ha, hs = _both(view, layer)
    cells = [[(layer, h)] for h in range(view[layer].n_heads)]
    cells += [[ha, hs], [(0, 2), hs], [ha, (layer + 1, 0)]]
    t, ref = make_task(), None if mode == "zero" else make_task(seed=5)
    res = I.ablation_sweep(
        m, t, "logit_diff", cells, mode=mode, positions=positions, reference=ref, pack=4,
        progress=False,
    )  # fmt: skip
    if strategy == "expand":
        assert res.info["paths"]["cells"] == ["expanded at the layer's output"], res.info
    if positions == "last":
        assert res.method == "incremental", res.info
    met, ids, idx = Metric("logit_diff", t), tokens(t), torch.arange(len(t))
    loop = []
    with torch.no_grad():
        scale = float(m(ids)[:, -1].abs().max())  # the logits the logit differences come from
        for cell in res.cells:
            with I.ablate_heads(m, list(cell), mode=mode, positions=positions, reference=ref):
                loop.append(met(m(ids)[:, -1], idx))
    # Equal up to float32 summation order (the packed batch and the loop run other kernels, which
    # differ by CPU: 1.18e-5 on an AVX2-only EPYC, under 1e-5 with AVX512): ~6 reductions per
    # layer over the widest dimension, logit differences of logits of this scale.
    cfg = m.cfg
    width = max(cfg.d_model, getattr(cfg, "d_inner", 0) or 0, getattr(cfg, "d_mlp", 0) or 0)
    bound = fp32_tolerance(scale, depth=6 * cfg.n_layers, width=width)
    assert (res.values - torch.stack(loop)).abs().max().item() <= bound
    assert bound < 0.01 * res.effects.abs().max().item()  # far below what the sweep measures
    assert res.effects.abs().min() > 0
    kinds = dict(zip(res.cells, res.kinds, strict=True))
    assert (kinds[(ha,)], kinds[(hs,)], kinds[tuple(sorted([ha, hs]))]) == (
        "attention",
        "ssm",
        "mixed",
    )
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
@pytest.mark.parametrize("mode", ["post", "pre"])
def test_masks_on_both_parts_equal_hand_written_pattern_edits(family, mode):
    """A mask on an attention head edits its part's pattern (pre: its scores), a mask on an
    SSM head of the same layer its mixer's materialized pattern (only that head and the rows
    the mask changes are materialized): the logits of hand-written edits of the full patterns."""
    from gna_lens.interventions import mask_patterns

    m = model(family)
    view = head_view(m)
    layer = _two_part_layer(view)
    ha, hs = _both(view, layer)
    ids = tokens(make_task())[:2]
    L = ids.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool)
    keep[-1, : L - 3] = False  # the query reads its last 3 keys only
    keep[6, 1:4] = False

    def by_hand(head):
        part, i = view.part_of(head)
        if part.kind == "attention" and mode == "pre":

            def edit(s, hook, i=i):
                s = s.clone()
                s[:, i] = s[:, i].masked_fill(~keep, torch.finfo(s.dtype).min)
                return s

            return part.scores_hook, edit

        def edit(p, hook, i=i):
            p = p.clone()
            p[:, i] = p[:, i] * keep
            return p

        return part.pattern_hook, edit

    with torch.no_grad():
        clean = m(ids)
        for heads in ([ha], [hs], [ha, hs]):
            with mask_patterns(m, {h: keep for h in heads}, mode=mode):
                got = m(ids)
            expected = m.run_with_hooks(ids, fwd_hooks=[by_hand(h) for h in heads])
            assert (got - expected).abs().max().item() < 1e-5, heads
            assert (got - clean).abs().max().item() > 1e-4, heads
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
@pytest.mark.parametrize("positions", [None, "last"])
def test_patching_heads_of_both_parts_equals_hand_written_patches(family, positions):
    from gna_lens.interventions.metrics import Metric

    m = model(family)
    view = head_view(m)
    layer = _two_part_layer(view)
    ha, hs = _both(view, layer)
    t = make_task()
    x = other_key(t)
    res = I.patch_heads(m, t, x, "logit_diff", heads=[ha, hs, [ha, hs]], positions=positions,
                        progress=False)  # fmt: skip
    met, idx = Metric("logit_diff", t), torch.arange(len(t))
    names = [view.part_of(h)[0].z_hook for h in (ha, hs)]
    cols = slice(None) if positions is None else slice(-1, None)
    with torch.no_grad():
        _, cache = m.run_with_cache(tokens(t), names_filter=names)
        for row, cell in enumerate(([ha], [hs], [ha, hs])):
            hooks = []
            for head in cell:
                part, i = view.part_of(head)

                def patch(z, hook, name=part.z_hook, i=i):
                    z = z.clone()
                    z[:, cols, i] = cache[name][:, cols, i]
                    return z

                hooks.append((part.z_hook, patch))
            expected = met(m.run_with_hooks(tokens(x), fwd_hooks=hooks)[:, -1], idx)
            assert (res.values[row] - expected).abs().max().item() < 1e-5, cell
    assert list(res.index_df["kind"]) == ["attention", "ssm", "mixed"]
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_attribution_of_both_parts_is_the_gradient_times_the_edit(family):
    """attribute_heads (zero ablation, and patching from the clean run) on an attention and an
    SSM head of one layer: each estimate is Σ (z' - z) · ∂metric/∂z over that head's slice of
    its own part's hook_z, computed here by hand."""
    from gna_lens.interventions.metrics import Metric

    m = model(family)
    view = head_view(m)
    layer = _two_part_layer(view)
    heads = list(_both(view, layer))
    t = make_task()
    x = other_key(t)
    met, idx = Metric("logit_diff", t), torch.arange(len(t))
    parts = [view.part_of(h) for h in heads]
    names = [p.z_hook for p, _ in parts]
    with torch.no_grad():
        _, clean = m.run_with_cache(tokens(t), names_filter=names)
    for corrupted in (None, x):
        res = I.attribute_heads(m, t, "logit_diff", corrupted=corrupted, heads=heads,
                                batch_size=len(t))  # fmt: skip
        leaves, acts = {}, {}

        def grab(z, hook, leaves=leaves, acts=acts):
            leaves[hook.name] = leaf = torch.zeros_like(z, requires_grad=True)
            acts[hook.name] = z.detach()
            return z + leaf

        ids = tokens(t if corrupted is None else corrupted)
        with torch.enable_grad():
            values = met(m.run_with_hooks(ids, fwd_hooks=[(n, grab) for n in names])[:, -1], idx)
            grads = torch.autograd.grad(values.sum(), [leaves[n] for n in names])
        for row, ((part, i), grad) in enumerate(zip(parts, grads, strict=True)):
            z = acts[part.z_hook]
            new = torch.zeros_like(z) if corrupted is None else clean[part.z_hook]
            est = ((new - z)[:, :, i] * grad[:, :, i]).sum((1, 2))
            assert (res.values[row] - res.baseline - est).abs().max().item() < 1e-5
        assert res.kinds == ("attention", "ssm")
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_pattern_scores_of_both_parts_equal_scores_of_the_full_patterns(family):
    """pattern_scores streams each part's pattern (the SSM part materializing only the scored
    rows of the wanted heads): the same per-sample scores as every part's whole pattern."""
    from gna_lens.scoring import pattern_scores
    from gna_lens.scoring.patterns import _capture_part_patterns, _sample_scores

    m = model(family)
    view = head_view(m)
    t = make_task(n_samples=4)
    layer = _two_part_layer(view)
    wanted = [(0, 1), *_both(view, layer), (layer, 0)]
    got = pattern_scores(m, t, heads=wanted, batch_size=2, progress=False)
    assert got.heads == tuple(wanted)
    assert got.kinds == tuple(view.kind_of(h) for h in wanted)
    parts = view.parts_of(wanted)
    bos = t.tokenizer.bos_token_id
    per = {(p.layer, p.offset): [] for p in parts}
    for batch in t.batches(4, padding_side="left"):
        with torch.no_grad(), _capture_part_patterns(m, view, parts) as store:
            m(batch.input_ids, attention_mask=batch.attention_mask)
        for key, rows in per.items():
            for b, (sample, off) in enumerate(zip(batch.samples, batch.offsets, strict=True)):
                n = sample.n_tokens
                sink = bos is not None and sample.input_ids[0] == bos
                P = store[key][b, :, off : off + n, off : off + n].double()
                rows.append(_sample_scores(P, sample, sink))
    where = [view.part_of(h) for h in wanted]
    ref = torch.stack([torch.stack(per[(p.layer, p.offset)])[:, i] for p, i in where], 1)
    assert torch.allclose(got.per_sample, ref.float(), atol=1e-5, equal_nan=True)
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_score_heads_pairs_and_report_widgets_cover_both_parts(family, tmp_path):
    """score_heads ranks every head of both kinds, find_gna_pairs runs its masks on them, and
    the report's pattern widgets show an attention and an SSM head of one layer (SSM rows as
    normalized |M|), read from their own parts' hooks."""
    from gna_lens import find_gna_pairs, score_heads
    from gna_lens.scoring.pipeline import _examples

    m = model(family)
    view = head_view(m)
    layer = _two_part_layer(view)
    ha, hs = _both(view, layer)
    t = make_task(n_samples=4)
    report = score_heads(m, t, control=None, n_examples=2, progress=False)
    df = report.to_dataframe()
    assert len(df) == view.n_heads_total
    rows = df[df["layer"] == layer].sort_values("head")
    assert list(rows["kind"]) == [view.kind_of((layer, h)) for h in range(view[layer].n_heads)]
    assert not rows["ablation_effect"].isna().any()
    assert not rows["aggregate_score"].isna().any()
    find_gna_pairs(m, t, report=report, n_candidates=2, progress=False)
    examples = _examples(m, t, [ha, hs])
    html = dataclasses.replace(report, examples=examples).to_html(tmp_path / "report.html")
    text = html.read_text()
    assert "CircuitsVis" in text and f"L{layer}H{ha[1]}" in text and f"L{layer}H{hs[1]}" in text
    ids = torch.tensor([t[0].input_ids])
    names = {h: view.part_of(h)[0].pattern_hook for h in (ha, hs)}
    with torch.no_grad():
        _, cache = m.run_with_cache(ids, names_filter=list(names.values()))
    for head in (ha, hs):
        part, i = view.part_of(head)
        p = cache[part.pattern_hook][0, i]
        if part.kind == "ssm":
            p = p.abs().tril()
            p = p / p.sum(-1, keepdim=True)
        got = torch.tensor(examples["patterns"][f"L{head[0]}H{head[1]}"])
        assert torch.allclose(got, p.float(), atol=1e-6), head
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_scan_ranks_both_parts_of_every_layer(family, tmp_path, monkeypatch):
    """``gna-lens scan`` on a model of two-part layers: every head of both kinds is scored and
    ranked, the report written, and the top heads removed on held-out prompts."""
    import json

    from gna_lens import scan as scan_module

    m = model(family)
    view = head_view(m)

    def tasks(tok_, task, n_samples, seed, n_eval=8, **kv):
        held_out = {"kv-4": make_task(n_pairs=4, n_samples=n_eval, seed=seed + 1)}
        return scan_module.ScanTasks(make_task(n_pairs=4, n_samples=n_samples), held_out)

    monkeypatch.setattr(scan_module, "build_tasks", tasks)
    result = scan_module.scan(
        m, n_samples=4, n_eval=4, top=3, out=tmp_path, control=None, random_draws=1,
        progress=False, force=True,
    )  # fmt: skip
    data = json.loads(result.json_path.read_text())
    assert data["layer_heads"] == [lh.n_heads if lh else 0 for lh in view.layers]
    scored = {(r["layer"], r["head"]): r["kind"] for r in data["heads"]}
    assert scored == {h: view.kind_of(h) for h in view.heads()}
    assert "CircuitsVis" in result.html_path.read_text()
    assert hook_count(m) == 0


# ----------------------------------------------------------------------------- layer targets
def _zero(x, hook):
    return torch.zeros_like(x)


def _mean_of(m, name, ref, cols):
    """The mean of hook ``name`` over the reference ids' positions ``cols`` (bool ``[pos]``:
    the ablated positions; the reference has the inputs' length and no BOS)."""
    with torch.no_grad():
        _, cache = m.run_with_cache(ref, names_filter=name)
    return cache[name][:, cols].reshape(-1, m.cfg.d_model).double().mean(0).float()


@pytest.mark.parametrize("family", sorted(MULTIPART))
@pytest.mark.parametrize("positions", [None, "last", [1, -2]])
def test_mixer_target_of_a_two_part_layer_replaces_both_parts(family, positions):
    """target='mixer' on a two-part layer replaces the outputs of both parts (Falcon-H1: the
    Mamba-2 mixer and the parallel attention; Zamba2: the shared block's attention and the
    layer's mixer), each by zero or by its own mean: the logits of hand-written hooks on both;
    'attn' / 'ssm' replace one part's only."""
    m = model(family)
    view = head_view(m)
    ids = tokens(make_task())[:3]
    ref = tokens(make_task(seed=5))
    L = ids.shape[1]
    assert ref.shape[1] == L
    cols = torch.zeros(L, dtype=torch.bool)
    cols[[-1] if positions == "last" else slice(None) if positions is None else positions] = True
    two = [lh.layer for lh in view if len(lh.parts) == 2]
    assert two == ([0, 1, 2] if family == "falcon_h1" else [1, 3, 4])
    for layer in two:
        out = {p.kind: p.out_hook for p in view[layer].parts}
        for mode in ("zero", "mean"):
            means = {k: _mean_of(m, n, ref, cols) for k, n in out.items()} if mode == "mean" else {}

            def hand(kind, mode=mode, means=means, out=out):
                def edit(x, hook):
                    value = means[kind] if mode == "mean" else torch.zeros(())
                    return torch.where(cols[None, :, None], value.to(x.dtype), x)

                return (out[kind], edit)

            kw = dict(mode=mode, positions=positions)
            if mode == "mean":
                kw["reference"] = ref
            got = {}
            with torch.no_grad():
                clean = m(ids)
                for target in ("mixer", "attn", "ssm"):
                    with I.ablate_layers(m, [layer], target=target, **kw):
                        got[target] = m(ids)
                both = m.run_with_hooks(ids, fwd_hooks=[hand("attention"), hand("ssm")])
                attn = m.run_with_hooks(ids, fwd_hooks=[hand("attention")])
                ssm = m.run_with_hooks(ids, fwd_hooks=[hand("ssm")])
            tol = 0.0 if mode == "zero" else 1e-5
            for target, expected in (("mixer", both), ("attn", attn), ("ssm", ssm)):
                assert (got[target] - expected).abs().max().item() <= tol, (layer, mode, target)
            # Each part matters, so the whole mixer is neither part alone; but on Zamba2 the
            # attention reaches the residual only through the mixer: replacing the mixer's
            # output at every position from the first edited one on hides the attention's edit.
            hidden = family == "zamba2" and positions in (None, "last")
            for a, b in (("mixer", "attn"), ("mixer", "ssm"), ("attn", "ssm")):
                diff = (got[a] - got[b]).abs().max().item()
                assert diff == 0.0 if hidden and b == "ssm" and a == "mixer" else diff > 1e-4, (
                    layer, mode, a, b
                )  # fmt: skip
            assert (got["mixer"] - clean).abs().max().item() > 1e-4
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
def test_zeroing_the_mixer_of_a_two_part_layer_leaves_only_its_mlp(family):
    """Zeroing the whole token mixer at every position: Falcon-H1's residual leaves the mixing
    sublayer unchanged (resid_mid == resid_pre); a Zamba2 hybrid layer (no MLP of its own after
    the mixer) becomes the identity, as remove_layers makes it."""
    m = model(family)
    layer = 1
    ids = tokens(make_task())[:2]
    pre, post = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"
    mid = f"blocks.{layer}.hook_resid_mid" if family == "falcon_h1" else post
    with torch.no_grad(), I.ablate_layers(m, [layer], target="mixer"):
        _, cache = m.run_with_cache(ids, names_filter=[pre, mid])
    assert torch.equal(cache[mid], cache[pre])
    if family == "zamba2":
        with torch.no_grad():
            with I.remove_layers(m, [layer]):
                removed = m(ids)
            with I.ablate_layers(m, [layer], target="mixer"):
                no_mixer = m(ids)
        assert torch.equal(no_mixer, removed)
        with pytest.raises(InterventionError, match=r"target='attn' at layer 0.*no attention"):
            I.layer_ablation_hooks(m, [0], target="attn")  # a Mamba-2 layer
    with pytest.raises(InterventionError, match="expected one of"):
        I.layer_ablation_hooks(m, [layer], target="shared")
    assert hook_count(m) == 0


@pytest.mark.parametrize("family", sorted(MULTIPART))
@pytest.mark.parametrize(
    "target,mode,positions",
    [("mixer", "zero", None), ("mixer", "mean", None), ("mixer", "zero", "last"),
     ("mixer", "mean", [2, -1]), ("attn", "zero", None), ("ssm", "mean", "last")],
)  # fmt: skip
def test_layer_sweep_of_a_two_part_mixer_equals_a_loop_and_hand_written_hooks(
    family, target, mode, positions
):
    """layer_sweep with target='mixer' (both parts) / 'attn' / 'ssm': the batched sweep (each
    layer run from its cached residual) equals the loop of full forwards, and each cell equals
    ablate_layers (itself checked against hand-written hooks above); a set of layers too."""
    from gna_lens.interventions.metrics import Metric

    m = model(family)
    t = make_task()
    ref = None if mode == "zero" else make_task(seed=5)
    two = [lh.layer for lh in head_view(m) if len(lh.parts) == 2]
    cells = [*two, two[:2]] if target != "ssm" else [*two]
    kw = dict(target=target, mode=mode, positions=positions, reference=ref, control=None,
              progress=False)  # fmt: skip
    res = I.layer_sweep(m, t, "logit_diff", cells, **kw)
    loop = I.layer_sweep(m, t, "logit_diff", cells, method="loop", **kw)
    assert (res.values - loop.values).abs().max().item() <= 1e-5
    met, ids, idx = Metric("logit_diff", t), tokens(t), torch.arange(len(t))
    with torch.no_grad():
        for row, cell in enumerate(res.cells):
            with I.ablate_layers(m, list(cell), target=target, mode=mode, positions=positions,
                                 reference=ref):  # fmt: skip
                expected = met(m(ids)[:, -1], idx)
            assert (res.values[row] - expected).abs().max().item() <= 1e-5, cell
    assert res.effects.abs().min() > 0
    assert res.method["target"] == target
    assert hook_count(m) == 0
