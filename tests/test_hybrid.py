"""Hybrid students (gna_lens.hybrid): build_hybrid, the HybridMixer and the gna_lens_hybrid family.

A student keeps some teacher heads as attention and turns the others into Mamba-2-style SSM heads
initialized from the head's own q / k / v. Checked here: a student keeping every head computes the
teacher's logits; an SSM head in the exact case (A = 0, dt = 1, D = 0, N = d_head) is causal
linear attention of the teacher head; the fast path (fused attention, chunked SSD in bfloat16
with float32 states) gives the materialized reference path's output and gradients; the one
hook_pattern reconstructs and edits both kinds of heads; the step equals the forward; the student runs through every analysis and sweep; save /
load round-trips bit-identically; bad inputs are refused with clear messages; no hook leaks.
"""

import functools
import math

import pytest
import torch
from interventions_helpers import hook_count, tokens
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions as I
from gna_lens.errors import ConfigError, InterventionError, PatternEditError
from gna_lens.heads import head_output_weights, head_view
from gna_lens.hybrid import build_hybrid, state_bytes
from gna_lens.models import HookedSSM, load_model
from gna_lens.testing import tiny_checkpoint, tiny_hf_model

KEEP = [(0, 1), (1, 2), (1, 3)]  # layer 0: one head of KV group 0; layer 1: KV group 1 whole
ALL = [(layer, h) for layer in range(2) for h in range(4)]
PATTERN = lambda name: name.endswith("hook_pattern")  # noqa: E731
IDENTITY = lambda t, hook: t  # noqa: E731


@functools.cache
def student(keep: tuple = tuple(KEEP), d_state: int = 8, layout: str = "head") -> HookedSSM:
    """A student of the interventions' tiny Llama bridge (word tokenizer of the KV tasks)."""
    return build_hybrid(helper_model("llama"), list(keep), d_state=d_state, head_layout=layout)


def _ids(b, length, seed=0, vocab=320):
    return torch.randint(2, vocab, (b, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- parity
ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_key_value_heads": 1, "tie_word_embeddings": True, "rope_parameters": ROPE_LLAMA3},
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0}},
    ],
    ids=["gqa", "mqa-tied-llama3", "mha-biases", "linear-rope"],
)
def test_keeping_every_head_reproduces_the_teacher(overrides):
    hf = tiny_hf_model("llama", seed=2, **overrides)
    full = build_hybrid(hf, ALL)
    with torch.no_grad():
        for length in (1, 23, 70):
            ids = _ids(2, length, length)
            ref = hf(ids).logits
            assert (full(ids) - ref).abs().max().item() < 1e-4, length
            mat = full.run_with_hooks(ids, fwd_hooks=[(PATTERN, IDENTITY)])
            assert (mat - ref).abs().max().item() < 1e-4, length
        ids = _ids(2, 21, 5)
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        ref = hf(ids, attention_mask=mask).logits
        out = full(ids, attention_mask=mask)
    assert (out[mask.bool()] - ref[mask.bool()]).abs().max().item() < 1e-4


def test_bridge_teacher_and_folder_teacher_give_the_same_student(tmp_path):
    from transformer_lens.model_bridge import TransformerBridge

    path = tiny_checkpoint("llama", tmp_path / "teacher")
    bridge = TransformerBridge.boot_transformers(str(path))
    from_bridge = build_hybrid(bridge, ALL)
    from_folder = build_hybrid(str(path), ALL)
    ids = _ids(2, 17)
    with torch.no_grad():
        ref = bridge(ids)
        assert (from_bridge(ids) - ref).abs().max().item() < 1e-4
        assert torch.equal(from_bridge(ids), from_folder(ids))
    assert from_bridge.cfg.teacher["name"] == str(path)
    assert from_bridge.cfg.teacher["model_type"] == "llama"
    assert from_bridge.tokenizer is not None and from_folder.tokenizer is not None


def test_ssm_head_in_the_exact_case_is_causal_linear_attention_of_the_teacher_head():
    """A = 0, dt = 1, D = 0, N = d_head: y_t = sum_{s<=t} (q_t . k_s / sqrt(d)) v_s."""
    hf = tiny_hf_model("llama", seed=4)
    s = build_hybrid(hf, [], d_state=8)
    s.cfg.chunk_size = 8  # several chunks in 30 positions
    mixer = s.blocks[0].mixer
    with torch.no_grad():
        mixer.A_log.fill_(-math.inf)
        mixer.dt_bias.fill_(math.log(math.e - 1))  # softplus^-1(1)
        mixer.D.zero_()
    ids = _ids(2, 30, 3)
    d, head = 8, 3  # head 3 reads KV head 1
    with torch.no_grad():
        h = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(ids))
        attn = hf.model.layers[0].self_attn
        rows = slice(head * d, head * d + d)
        kv = slice(1 * d, 2 * d)
        q = h @ attn.q_proj.weight[rows].T
        k = h @ attn.k_proj.weight[kv].T
        v = h @ attn.v_proj.weight[kv].T
        scores = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(d)
        expected = torch.einsum("bij,bjd->bid", scores.tril(), v)
        _, cache = s.run_with_cache(ids, names_filter="blocks.0.mixer.hook_ssm_out")
        got = cache["blocks.0.mixer.hook_ssm_out"][:, :, head]
        assert (got - expected).abs().max().item() < 1e-5
        # the materialized matrix is the un-normalized score matrix
        _, mat = s.run_with_cache(ids, names_filter="blocks.0.mixer.hook_pattern")
        pattern = mat["blocks.0.mixer.hook_pattern"][:, head]
        assert (pattern - scores.tril()).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------- structure
def test_keep_none_some_all_have_the_right_kinds_and_head_counts():
    none, some, full = student(()), student(), student(tuple(ALL))
    assert [lh.kind for lh in head_view(none)] == ["ssm", "ssm"]
    assert [lh.kind for lh in head_view(full)] == ["attention", "attention"]
    view = head_view(some)
    assert [(lh.kind, lh.n_heads, lh.d_head) for lh in view] == [("mixed", 4, 8)] * 2
    assert view.heads("attention") == KEEP
    assert view.heads("ssm") == [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert [view.kind_of((1, h)) for h in range(4)] == ["ssm", "ssm", "attention", "attention"]
    assert view[0].scores_hook is None and head_view(full)[0].scores_hook is not None
    assert view.to_dataframe()["attention_heads"].tolist() == [[1], [2, 3]]
    # GQA: layer 0 keeps KV head 0 only, layer 1 KV head 1 only
    m0, m1 = some.blocks[0].mixer, some.blocks[1].mixer
    assert (m0.kv_heads, m1.kv_heads) == ([0], [1])
    assert tuple(m0.k_proj.weight.shape) == (8, 32) and tuple(m1.q_proj.weight.shape) == (16, 32)
    assert tuple(m0.c_proj.weight.shape) == (3 * 8, 32) and not hasattr(
        full.blocks[0].mixer, "c_proj"
    )
    grouped = student(layout="kv_group").blocks[0].mixer
    assert grouped.ssm_groups == [0, 1]  # heads 0 | 2, 3
    assert tuple(grouped.b_proj.weight.shape) == (2 * 8, 32)
    ids = tokens(make_task())[:2]
    with torch.no_grad():
        _, cache = some.run_with_cache(ids)
    assert tuple(cache["blocks.0.mixer.hook_z"].shape[2:]) == (4, 8)
    assert tuple(cache["blocks.0.mixer.hook_q"].shape[2:]) == (1, 8)
    assert tuple(cache["blocks.0.mixer.hook_ssm_input"].shape[2:]) == (3, 8)
    assert tuple(cache["blocks.1.mixer.hook_ssm_B"].shape[2:]) == (2, 8)
    # out_hook == z @ W_O over every head of the mixed layer
    w = head_output_weights(some, 1)
    out = torch.einsum("bphd,hdm->bpm", cache["blocks.1.mixer.hook_z"], w)
    assert (out - cache["blocks.1.hook_mixer_out"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", ["head", "kv_group"])
def test_pattern_reconstructs_both_kinds_and_edits_take_effect(layout):
    m = student(layout=layout)
    ids = tokens(make_task())[:2]
    pre = "blocks.1.mixer."
    names = [pre + n for n in ("hook_v", "hook_ssm_input", "hook_z")]
    with torch.no_grad():
        clean, fast = m.run_with_cache(ids, names_filter=names)
        _, mat = m.run_with_cache(ids, names_filter=pre + "hook_pattern")
    v, x, z = (fast[n] for n in names)
    pattern = mat[pre + "hook_pattern"]
    mixer = m.blocks[1].mixer
    D = mixer.D.detach()

    def recon(p):
        out = torch.empty_like(z)
        for i, h in enumerate(mixer.attn_heads):  # P @ v of the head's KV head
            out[:, :, h] = p[:, h] @ v[:, :, mixer.attn_kv[i]]
        for i, h in enumerate(mixer.ssm_heads):  # M @ x + D x
            out[:, :, h] = p[:, h] @ x[:, :, i] + D[i] * x[:, :, i]
        return out

    assert ((recon(pattern) - z).norm() / z.norm()).item() < 1e-5
    assert torch.allclose(pattern[:, mixer.attn_heads].sum(-1), torch.ones(1))
    assert pattern.triu(1).abs().max().item() == 0.0

    def edit(p, hook):  # every head reads only its own position
        return torch.diag_embed(torch.diagonal(p, dim1=-2, dim2=-1))

    cache: dict = {}
    with torch.no_grad():
        edited = m.run_with_hooks(
            ids, fwd_hooks=[(pre + "hook_pattern", edit), (pre + "hook_z", _grab(cache))]
        )
    assert (cache[pre + "hook_z"] - recon(edit(pattern, None))).abs().max().item() < 1e-5
    assert (edited - clean).abs().max().item() > 1e-4
    # a selection materializes a subset; its entries are the full pattern's
    with torch.no_grad(), m.pattern_selection(heads={1: [0, 3]}, query_positions=[2, -1]):
        _, sel = m.run_with_cache(ids, names_filter=pre + "hook_pattern")
    L = ids.shape[1]
    expected = pattern[:, [0, 3]][:, :, [2, L - 1]]
    assert (sel[pre + "hook_pattern"] - expected).abs().max().item() < 1e-6


def _grab(cache):
    def hook(t, hook):
        cache[hook.name] = t.detach().clone()

    return hook


@pytest.mark.parametrize("keep", [(), tuple(KEEP), tuple(ALL)], ids=["none", "some", "all"])
def test_step_from_the_prefix_equals_the_full_forward(keep):
    m = student(keep)
    ids = tokens(make_task())[:3]
    with torch.no_grad():
        full = m(ids)[:, -1]
        logits, prefix = m.prefix_state(ids)
        again = m.step(prefix)
        zero = lambda t, hook: t.index_fill(2, torch.tensor([0, 2]), 0.0)  # noqa: E731
        ablated_full = m.run_with_hooks(ids, fwd_hooks=[("blocks.1.mixer.hook_z", zero)])[:, -1]
        with m.hooks(fwd_hooks=[("blocks.1.mixer.hook_z", zero)]):
            ablated_step = m.step(prefix)
    assert (logits - full).abs().max().item() < 1e-5
    assert (again - full).abs().max().item() < 1e-5
    assert (ablated_step - ablated_full).abs().max().item() < 1e-5
    assert (ablated_full - full).abs().max().item() > 1e-4


@pytest.mark.parametrize("layout", ["head", "kv_group"])
def test_the_fast_path_equals_the_materialized_reference(layout, monkeypatch):
    """Unhooked, every layer runs one fused attention over its attention heads and one chunked
    SSD scan over its SSM heads (counted here); with hook_pattern hooked it materializes every
    head's matrix. Same logits (left- and right-padded rows too) and gradients to float32
    rounding, at 150 positions (three chunks of 64, the last one short)."""
    from gna_lens.models.mixers import hybrid as mixer_module

    hf = tiny_hf_model("llama", seed=2)
    m = build_hybrid(hf, [(0, 1), (1, 0), (1, 3)], d_state=8, head_layout=layout)
    with torch.no_grad():
        for block in m.blocks:  # dt depends on the input, as after training
            block.mixer.dt_proj.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    ids = _ids(3, 150)
    mask = torch.ones(3, 150, dtype=torch.long)
    mask[0, :20] = 0  # left padding
    mask[1, 100:] = 0  # right padding
    calls = {"sdpa": 0, "ssd": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        counted("sdpa", torch.nn.functional.scaled_dot_product_attention),
    )
    monkeypatch.setattr(mixer_module, "ssd_chunked", counted("ssd", mixer_module.ssd_chunked))
    materialized = [(f"blocks.{i}.mixer.hook_pattern", lambda t, hook: None) for i in range(2)]
    for attention_mask in (None, mask):
        fast = m(ids, attention_mask=attention_mask)
        assert calls == {"sdpa": 2, "ssd": 2}  # both layers mix both kinds: one call each
        ref = m.run_with_hooks(ids, attention_mask=attention_mask, fwd_hooks=materialized)
        assert calls == {"sdpa": 2, "ssd": 2}  # the reference path calls neither
        assert (fast - ref).abs().max().item() < 2e-5 * ref.abs().max().item()
        calls.update(sdpa=0, ssd=0)
    ssm = [p for n, p in m.named_parameters() if any(k in n for k in ("c_proj", "A_log", "dt_"))]
    grads = []
    for hooks in ([], materialized):
        with m.hooks(fwd_hooks=hooks):
            grads.append(torch.autograd.grad(m(ids, return_type="loss"), ssm))
    for fast_grad, ref_grad in zip(*grads, strict=True):
        assert (fast_grad - ref_grad).norm() <= 1e-4 * ref_grad.norm()
    # hook_attn_scores hooked: the explicit softmax, the same output
    scores = [(f"blocks.{i}.mixer.hook_attn_scores", IDENTITY) for i in range(2)]
    assert (m.run_with_hooks(ids, fwd_hooks=scores) - m(ids)).abs().max().item() < 1e-5


def test_the_ssd_scan_keeps_float32_states_under_bfloat16_autocast():
    """Under bfloat16 autocast only the within-chunk products run in bfloat16: the result is
    float32 and within bfloat16 rounding of the float32 scan (of ops.mamba2_ssd, in float64)."""
    from gna_lens.models.mixers.hybrid import ssd_chunked
    from gna_lens.models.ops import mamba2_ssd

    gen = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(2, 200, 3, k, generator=gen) for k in (16, 8, 8))
    dt = torch.rand(2, 200, 3, generator=gen) * 0.2
    A = -torch.tensor([0.5, 2.0, 8.0])
    ref = mamba2_ssd(*(t.double() for t in (x, dt, A, B, C)), chunk_size=256)
    assert (ssd_chunked(x, dt, A, B, C) - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ssd_chunked(x, dt, A, B, C)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_a_bf16_student_runs_forward_step_and_backward():
    hf = tiny_hf_model("llama", seed=1)
    ref = build_hybrid(hf, KEEP, d_state=8)
    low = build_hybrid(hf, KEEP, d_state=8, dtype=torch.bfloat16)
    ids = _ids(2, 40)
    with torch.no_grad():
        out = low(ids)
        step = low.step(low.prefix_state(ids)[1])
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref(ids)).abs().max().item() < 0.2  # bf16 rounding of logits ~4
        assert (step.float() - out[:, -1].float()).abs().max().item() < 0.1
    ref.train()
    ref(ids, return_type="loss").backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in ref.parameters())


# ----------------------------------------------------------------------------- analyses
@pytest.mark.parametrize("positions", [None, "last"])
@pytest.mark.parametrize("mode", ["zero", "mean", "resample"])
def test_batched_sweep_equals_loop_and_leaves_no_hook(mode, positions):
    m = student()
    t = make_task()
    ref = None if mode == "zero" else make_task(seed=5)
    before = hook_count(m)
    res = I.ablation_sweep(
        m, t, "logit_diff", mode=mode, positions=positions, reference=ref, pack=5, progress=False
    )
    from gna_lens.interventions.metrics import Metric

    ids, idx, met, loop = tokens(t), torch.arange(len(t)), Metric("logit_diff", t), []
    with torch.no_grad():
        for head in head_view(m).heads():
            with I.ablate_heads(m, [head], mode=mode, positions=positions, reference=ref):
                loop.append(met(m(ids)[:, -1], idx))
    assert (res.values - torch.stack(loop)).abs().max().item() <= 1e-5
    assert res.effects.abs().max() > 1e-3
    assert res.kinds == tuple(head_view(m).kind_of(h) for (h,) in res.cells)
    if positions == "last":
        assert res.method == "incremental", res.info
    assert hook_count(m) == before


def test_scores_patching_attribution_and_masks_run_on_a_student():
    m = student()
    t = make_task()
    before = hook_count(m)
    from gna_lens import score_heads
    from gna_lens.scoring.patterns import pattern_scores

    report = score_heads(m, t, control=None, progress=False, n_examples=2)
    df = report.to_dataframe().set_index(["layer", "head"])
    assert df.loc[(1, 2), "kind"] == "attention" and df.loc[(1, 0), "kind"] == "ssm"
    scores = pattern_scores(m, t, progress=False)
    assert scores.kinds == tuple(head_view(m).kind_of(h) for h in scores.heads)
    from interventions_helpers import other_key

    patched = I.patch_heads(m, t, other_key(t), progress=False)
    assert patched.values.shape[0] == head_view(m).n_heads_total
    attr = I.attribute_heads(m, t)
    assert bool(torch.isfinite(attr.values).all())
    assert hook_count(m) == before


@pytest.mark.parametrize("head", [(1, 2), (1, 0)], ids=["attention", "ssm"])
def test_masks_on_a_mixed_layer_pre_and_post(head):
    m = student()
    ids = tokens(make_task())[:2]
    L = ids.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool)
    keep[-1, 3:-1] = False  # the last query drops some keys
    before = hook_count(m)
    with torch.no_grad():
        clean = m(ids)
        with I.mask_patterns(m, {head: keep}, mode="post"):
            post = m(ids)
        with I.mask_patterns(m, {head: keep}, mode="pre"):
            pre = m(ids)
    assert (post - clean).abs().max().item() > 1e-5
    mixer = m.blocks[1].mixer
    if head[1] in mixer.attn_heads:
        # "pre" on an attention head: the softmax over the kept keys, i.e. the scores masked
        i = mixer.attn_heads.index(head[1])

        def scores(s, hook):
            s[:, i] = s[:, i].masked_fill(~keep, torch.finfo(s.dtype).min)
            return s

        with torch.no_grad():
            ref = m.run_with_hooks(ids, fwd_hooks=[("blocks.1.mixer.hook_attn_scores", scores)])
        assert (pre - ref).abs().max().item() < 1e-5
        assert (pre - post).abs().max().item() > 1e-5
    else:
        assert (pre - post).abs().max().item() < 1e-6  # SSM heads: "pre" multiplies as "post"
    assert hook_count(m) == before


def test_scan_cli_runs_on_a_saved_student(tmp_path, capsys):
    import json

    from gna_lens.cli import main
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    tok = word_tokenizer(
        [
            "Below is a list of key-value pairs. What is the value for key ? :",
            "Memorize the following dictionary: The value of the key ' is",
            " ".join(load_words()[:40]),
        ],
        bos=True,
    )
    s = build_hybrid(tiny_hf_model("llama", vocab_size=len(tok)), KEEP, d_state=4, tokenizer=tok)
    folder = s.save_pretrained(tmp_path / "student")
    args = ["scan", str(folder), "--n-samples", "4", "--top", "2", "--control", "none", "--force"]
    args += ["--out", str(tmp_path / "report")]
    assert main([*args, "--random-draws", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    kinds = {(r["layer"], r["head"]): r["kind"] for r in data["heads"]}
    assert kinds[(1, 2)] == "attention" and kinds[(0, 0)] == "ssm"
    assert data["provenance"]["format"] == "gna_lens"


# ----------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trips_bit_identically(tmp_path, tied):
    hf = tiny_hf_model("llama", seed=1, tie_word_embeddings=tied)
    s = build_hybrid(hf, KEEP, d_state=12, head_layout="kv_group", seed=3)
    from gna_lens.testing import tiny_tokenizer

    s.tokenizer = tiny_tokenizer()
    folder = s.save_pretrained(tmp_path / "student")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    for loaded in (load_model(str(folder)), HookedSSM.from_pretrained(str(folder))):
        assert isinstance(loaded, HookedSSM)
        a, b = s.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        cfg = loaded.cfg
        assert cfg.attention_heads == [[1], [2, 3]] and cfg.d_state == 12
        assert cfg.ssm_head_layout == "kv_group" and cfg.teacher["model_type"] == "llama"
        assert cfg.tie_word_embeddings == tied
        ids = _ids(2, 19)
        with torch.no_grad():
            assert torch.equal(s(ids), loaded(ids))
        assert loaded.tokenizer is not None
    prov = load_model(str(folder)).gna_provenance
    assert prov.format == "gna_lens" and prov.files[0][0] == "model.safetensors"


def test_save_pretrained_refuses_other_families(tmp_path):
    from gna_lens.testing import tiny_hooked_ssm

    with pytest.raises(ConfigError, match="gna_lens_hybrid"):
        tiny_hooked_ssm("mamba2").save_pretrained(tmp_path / "x")


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_are_refused_with_clear_messages():
    teacher = tiny_hf_model("llama")
    with pytest.raises(ConfigError, match=r"model_type='mamba2'.*Llama-style"):
        build_hybrid(tiny_hf_model("mamba2"), [])
    with pytest.raises(ConfigError, match=r"\(2, 0\).*2 layers \(0\.\.1\) of 4 heads \(0\.\.3\)"):
        build_hybrid(teacher, [(0, 1), (2, 0)])
    with pytest.raises(ConfigError, match=r"\(0, 4\), which is not a head"):
        build_hybrid(teacher, [(0, 4)])
    with pytest.raises(ConfigError, match="one \\(layer, head\\) pair"):
        build_hybrid(teacher, (0, 1))
    with pytest.raises(ConfigError, match="contains 'a'"):
        build_hybrid(teacher, ["a"])
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match=f"d_state={bad!r}"):
            build_hybrid(teacher, [], d_state=bad)
    with pytest.raises(ConfigError, match="head_layout='group'"):
        build_hybrid(teacher, [], head_layout="group")
    with pytest.raises(ConfigError, match="rope_type"):
        build_hybrid(
            tiny_hf_model("llama", rope_parameters={"rope_type": "yarn", "factor": 2.0}), []
        )


def test_no_hook_remains_after_errors():
    m = student()
    before = hook_count(m)
    ids = tokens(make_task())[:2]
    wrong = {(1, 0): torch.ones(3, 3, dtype=torch.bool)}  # a mask of the wrong size
    with pytest.raises(PatternEditError), torch.no_grad(), I.mask_patterns(m, wrong):
        m(ids)  # raised inside the hook

    def boom(t, hook):
        raise RuntimeError("inside hook")

    with pytest.raises(RuntimeError, match="inside hook"):
        m.run_with_hooks(ids, fwd_hooks=[(PATTERN, IDENTITY), ("blocks.0.mixer.hook_z", boom)])
    with pytest.raises(RuntimeError, match="inside hook"):
        m.run_with_hooks(ids, fwd_hooks=[("blocks.1.mixer.hook_attn_scores", boom)])
    prefix = m.prefix_state(ids)[1]
    hooks = [("blocks.0.mixer.hook_pattern", IDENTITY)]
    with pytest.raises(InterventionError, match="last-token step"), m.hooks(fwd_hooks=hooks):
        m.step(prefix)  # the step materializes no pattern: refused
    assert hook_count(m) == before


# ----------------------------------------------------------------------------- state bytes
def test_state_bytes_of_teacher_and_students():
    teacher = helper_model("llama")  # 2 layers, 4 query heads over 2 KV heads of 8, fp32
    t = state_bytes(teacher)
    assert (t.recurrent_bytes, t.kv_bytes_per_token) == (0, 2 * 2 * 2 * 8 * 4)
    none = state_bytes(student(()))
    assert none.kv_bytes_per_token == 0
    assert none.recurrent_bytes == 2 * 4 * 8 * 8 * 4  # layers * heads * d_head * d_state * fp32
    some = state_bytes(student(), lengths=(128, 4096))
    assert some.kv_bytes_per_token == 2 * 2 * 8 * 4  # one KV head per layer
    assert some.recurrent_bytes == 5 * 8 * 8 * 4
    assert (some.attention_heads, some.ssm_heads, some.kv_heads) == (3, 5, 2)
    df = some.to_dataframe()
    assert df["length"].tolist() == [128, 4096]
    assert df["kv_cache_bytes"].tolist() == [128 * 128, 4096 * 128]
    assert (
        state_bytes(student(()), dtype=torch.bfloat16).recurrent_bytes == none.recurrent_bytes // 2
    )
