"""gna_lens.hybrid.swap_teacher_heads: single SSM heads replaced by their teacher's attention heads.

Checked here, on a Llamba student (DiscreteMamba2 layers) that shares a tiny Llama teacher's
embeddings, norms and MLPs, and on hybrid students of build_hybrid: swapping every head gives the
teacher's logits (fast and materialized paths, grouped-query and full heads, biases, scaled
RoPE); one swapped head changes the output only from its layer on and leaves the other heads'
hook_z as they were (also under Mamba-2's gated norm, which mixes a group of heads); the inputs
are never modified; head_view reports the swapped heads as attention; a pattern edit and an
ablation of a swapped head act through the teacher's o_proj columns exactly as predicted; the
incremental step equals the forward's last position; a swapped hybrid saves and loads back, a
swapped Llamba refuses to save; bad heads, students and teachers are refused naming them.
"""

import copy
import functools
import re

import pytest
import torch
from interventions_helpers import hook_count

from gna_lens.errors import ConfigError
from gna_lens.heads import head_view
from gna_lens.hybrid import build_hybrid, swap_teacher_heads
from gna_lens.interventions import ablate_heads
from gna_lens.models import HookedSSM, load_model
from gna_lens.models.mixers import TeacherHeadsMixer
from gna_lens.testing import tiny_hf_model, tiny_hooked_ssm

#: Teacher configs: grouped-query heads; full heads with a scaled RoPE.
CONFIGS = {
    "gqa": {},
    "mha-linear-rope": {
        "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
    },
}


def _ids(length: int = 13, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(2, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _every(n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    return [(layer, h) for layer in range(n_layers) for h in range(n_heads)]


@functools.cache
def _llamba_pair(config: str = "gqa", n_layers: int = 2) -> tuple[HookedSSM, object]:
    """A tiny Llama teacher (4 heads of 8, d_model 32) and a Llamba student of its shape with
    the teacher's embeddings, norms, MLPs and unembedding (its mixers are its own)."""
    teacher = tiny_hf_model(
        "llama", seed=3, num_hidden_layers=n_layers, rms_norm_eps=1e-5, **CONFIGS[config]
    )
    student = tiny_hooked_ssm("llamba", n_layer=n_layers)
    with torch.no_grad():
        student.embed.weight.copy_(teacher.model.embed_tokens.weight)
        student.ln_final.weight.copy_(teacher.model.norm.weight)
        student.unembed.weight.copy_(teacher.lm_head.weight)
        for block, layer in zip(student.blocks, teacher.model.layers, strict=True):
            block.ln1.load_state_dict(layer.input_layernorm.state_dict())
            block.ln2.load_state_dict(layer.post_attention_layernorm.state_dict())
            block.mlp.load_state_dict(layer.mlp.state_dict())
    return student, teacher


@functools.cache
def _mamba2_pair() -> tuple[HookedSSM, object]:
    """A tiny Mamba-2 (8 heads of 8 in 2 groups, gated RMSNorm over 4 heads at a time) and a
    Llama teacher with heads of that shape."""
    student = tiny_hooked_ssm("mamba2")
    teacher = tiny_hf_model("llama", seed=5, num_attention_heads=8, head_dim=8)
    return student, teacher


@functools.cache
def _hybrid(config: str = "gqa", layout: str = "head") -> tuple[HookedSSM, object]:
    """A hybrid student keeping heads (0, 1) and (1, 3) of its teacher as attention."""
    teacher = tiny_hf_model("llama", seed=3, **CONFIGS[config])
    return build_hybrid(teacher, [(0, 1), (1, 3)], d_state=8, head_layout=layout), teacher


def _teacher_o(teacher, layer: int, head: int) -> torch.Tensor:
    """The teacher's o_proj columns of ``head`` ``[d_model, d_head]``."""
    d = teacher.config.head_dim
    return teacher.model.layers[layer].self_attn.o_proj.weight[:, head * d : (head + 1) * d]


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_head_of_a_llamba_swapped_gives_the_teachers_logits(config):
    student, teacher = _llamba_pair(config)
    swapped = swap_teacher_heads(student, teacher, _every(2, 4))
    assert isinstance(swapped.blocks[0].mixer, TeacherHeadsMixer)
    ids = _ids()
    with torch.no_grad():
        ref = teacher(ids).logits
        assert _gap(student(ids), ref) > 1e-2  # the student alone is not the teacher
        assert _gap(swapped(ids), ref) < 1e-4
        # the materialized path (hook_pattern hooked) and the explicit softmax too
        for name in ("hook_pattern", "hook_attn_scores"):
            out = swapped.run_with_hooks(
                ids, fwd_hooks=[(lambda n, name=name: n.endswith(name), lambda t, hook: t)]
            )
            assert _gap(out, ref) < 1e-4, name


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", ["head", "kv_group"])
def test_every_ssm_head_of_a_hybrid_swapped_gives_the_teachers_logits(config, layout):
    student, teacher = _hybrid(config, layout)
    ssm = [p for p in _every(2, 4) if p not in [(0, 1), (1, 3)]]
    swapped = swap_teacher_heads(student, teacher, ssm)
    assert swapped.cfg.attention_heads == [[0, 1, 2, 3], [0, 1, 2, 3]]
    ids = _ids(seed=1)
    with torch.no_grad():
        ref = teacher(ids).logits
        assert _gap(student(ids), ref) > 1e-2
        assert _gap(swapped(ids), ref) < 1e-4


# ----------------------------------------------------------------------------- one head
def _z_and_resid(model: HookedSSM, ids: torch.Tensor, layer: int):
    names = [f"blocks.{i}.hook_resid_pre" for i in range(model.cfg.n_layers)]
    names += [f"blocks.{layer}.mixer.hook_z", f"blocks.{layer}.hook_mixer_out"]
    names += [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names)  # the fast path
    return cache


@pytest.mark.parametrize("which", ["llamba", "mamba2", "hybrid-head", "hybrid-kv_group"])
def test_one_swapped_head_changes_only_its_slice_and_what_follows(which):
    if which == "llamba":
        student, teacher = _llamba_pair(n_layers=3)
        layer, head = 1, 2
    elif which == "mamba2":
        student, teacher = _mamba2_pair()
        layer, head = 1, 5
    else:
        student, teacher = _hybrid(layout=which.split("-")[1])
        layer, head = 1, 0
    swapped = swap_teacher_heads(student, teacher, [(layer, head)])
    ids = _ids(seed=2)
    before, after = _z_and_resid(student, ids, layer), _z_and_resid(swapped, ids, layer)
    for i in range(layer + 1):
        name = f"blocks.{i}.hook_resid_pre"
        assert torch.equal(after[name], before[name]), name
    z_before, z_after = (
        before[f"blocks.{layer}.mixer.hook_z"],
        after[f"blocks.{layer}.mixer.hook_z"],
    )
    others = [h for h in range(student.cfg.n_heads) if h != head]
    assert _gap(z_after[:, :, others], z_before[:, :, others]) < 1e-6
    assert _gap(z_after[:, :, head], z_before[:, :, head]) > 1e-3
    mixer_out = f"blocks.{layer}.hook_mixer_out"
    last = f"blocks.{student.cfg.n_layers - 1}.hook_resid_post"
    assert _gap(after[mixer_out], before[mixer_out]) > 1e-3
    assert _gap(after[last], before[last]) > 1e-3
    # the swapped head writes through the teacher's o_proj columns, the others through the
    # student's own output columns
    d = student.cfg.d_head
    mixer, old = swapped.blocks[layer].mixer, student.blocks[layer].mixer
    assert torch.equal(
        mixer.out_proj.weight[:, head * d : (head + 1) * d], _teacher_o(teacher, layer, head)
    )
    keep = [c for h in others for c in range(h * d, (h + 1) * d)]
    assert torch.equal(mixer.out_proj.weight[:, keep], old.out_proj.weight[:, keep])


def test_head_view_reports_the_swapped_heads_as_attention():
    student, teacher = _llamba_pair()
    swapped = swap_teacher_heads(student, teacher, [(1, 2), (0, 0), (0, 1), (0, 2), (0, 3)])
    view = head_view(swapped)
    assert (view.kind(0), view.kind(1)) == ("attention", "mixed")
    assert [view.kind_of((1, h)) for h in range(4)] == ["ssm", "ssm", "attention", "ssm"]
    assert [head_view(student).kind(i) for i in range(2)] == ["ssm", "ssm"]
    record = swapped.gna_head_swap
    assert record["heads"] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 2]]
    assert isinstance(record["teacher"], str)
    # a further swap in another layer stacks, and records the earlier one
    first = swap_teacher_heads(student, teacher, [(1, 2)])
    again = swap_teacher_heads(first, teacher, [(0, 3)])
    assert [head_view(again).kind_of(p) for p in [(0, 3), (1, 2), (0, 0)]] == [
        "attention",
        "attention",
        "ssm",
    ]
    assert again.gna_head_swap["before"]["heads"] == [[1, 2]]


# ----------------------------------------------------------------------------- the inputs
def test_the_student_and_the_teacher_are_not_modified():
    for student, teacher, heads in (
        (*_llamba_pair(), [(0, 1), (1, 2)]),
        (*_hybrid(), [(0, 0), (1, 2)]),
    ):
        weights = {k: v.clone() for k, v in student.state_dict().items()}
        teacher_weights = {k: v.clone() for k, v in teacher.state_dict().items()}
        cfg = copy.deepcopy(student.cfg)
        kinds = [head_view(student).kind(i) for i in range(2)]
        swapped = swap_teacher_heads(student, teacher, heads)
        assert swapped is not student and swapped.cfg is not student.cfg
        with torch.no_grad():  # the new model shares no tensor with either input
            for p in swapped.parameters():
                p.add_(1.0)
        assert student.cfg == cfg
        assert not hasattr(student, "gna_head_swap")
        assert [head_view(student).kind(i) for i in range(2)] == kinds
        for k, v in student.state_dict().items():
            assert torch.equal(v, weights[k]), k
        for k, v in teacher.state_dict().items():
            assert torch.equal(v, teacher_weights[k]), k
    assert "rope_inv_freq" not in _llamba_pair()[0]._buffers  # the Llamba still has no RoPE


# ----------------------------------------------------------------------------- interventions
def _swapped_llamba() -> tuple[HookedSSM, object]:
    student, teacher = _llamba_pair()
    return swap_teacher_heads(student, teacher, [(1, 2), (1, 3)]), teacher


def test_a_pattern_edit_of_a_swapped_head_changes_the_output_as_predicted():
    swapped, teacher = _swapped_llamba()
    ids = _ids(length=9, seed=3)
    L = ids.shape[1]
    uniform = torch.ones(L, L).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)

    def edit(pattern, hook):
        pattern[:, 2] = uniform
        return pattern

    names = ["blocks.1.mixer.hook_z", "blocks.1.mixer.hook_v", "blocks.1.hook_mixer_out"]
    with torch.no_grad():
        clean_logits, clean = swapped.run_with_cache(ids, names_filter=names)
        with swapped.hooks(fwd_hooks=[("blocks.1.mixer.hook_pattern", edit)]):
            edited_logits, edited = swapped.run_with_cache(ids, names_filter=names)
    assert hook_count(swapped) == 0
    # heads 2 and 3 read the teacher's KV head 1 (4 query heads over 2 KV heads), the mixer's
    # only KV head (hook_v's kv_head 0); head 2's output is the edited pattern times its values
    assert swapped.blocks[1].mixer.kv_heads == [1]
    v = clean["blocks.1.mixer.hook_v"][:, :, 0]
    z_edit = edited["blocks.1.mixer.hook_z"]
    assert _gap(z_edit[:, :, 2], torch.einsum("qk,bkd->bqd", uniform, v)) < 1e-5
    z_clean = clean["blocks.1.mixer.hook_z"]
    assert _gap(z_edit[:, :, [0, 1, 3]], z_clean[:, :, [0, 1, 3]]) < 1e-5
    # ... which reaches the residual stream through the teacher's o_proj columns of head 2
    change = (z_edit[:, :, 2] - z_clean[:, :, 2]) @ _teacher_o(teacher, 1, 2).T
    got = edited["blocks.1.hook_mixer_out"] - clean["blocks.1.hook_mixer_out"]
    assert change.abs().max() > 1e-3
    assert _gap(got, change) < 1e-5
    assert _gap(edited_logits, clean_logits) > 1e-3


def test_ablating_a_swapped_head_removes_its_teacher_o_proj_contribution():
    swapped, teacher = _swapped_llamba()
    ids = _ids(seed=4)
    with torch.no_grad():
        clean, cache = swapped.run_with_cache(ids, names_filter="blocks.1.mixer.hook_z")
        with ablate_heads(swapped, [(1, 3)]):
            ablated = swapped(ids)
        contribution = cache["blocks.1.mixer.hook_z"][:, :, 3] @ _teacher_o(teacher, 1, 3).T

        def remove(out, hook):
            return out - contribution

        predicted = swapped.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_mixer_out", remove)])
        again = swapped(ids)
    assert _gap(ablated, clean) > 1e-3
    assert _gap(ablated, predicted) < 1e-5
    assert torch.equal(again, clean)
    assert hook_count(swapped) == 0


@pytest.mark.parametrize("which", ["llamba", "mamba2"])
def test_the_materialized_path_of_mixed_heads_equals_the_fast_path(which):
    """hook_pattern hooked with every head, or a selection of SSM and swapped heads and rows:
    the pattern of a swapped head is its softmax, the output is the fast path's."""
    if which == "llamba":
        swapped, _ = _swapped_llamba()  # heads 2, 3 of layer 1
        selection = [1, 2]
    else:
        student, teacher = _mamba2_pair()
        swapped = swap_teacher_heads(student, teacher, [(1, 1), (1, 6)])
        selection = [0, 1, 5]
    ids = _ids(length=10, seed=7)
    cached = {}

    def keep(pattern, hook):
        cached[hook.name] = pattern.clone()

    hooks = [("blocks.1.mixer.hook_pattern", keep)]
    with torch.no_grad():
        fast = swapped(ids)
        assert _gap(swapped.run_with_hooks(ids, fwd_hooks=hooks), fast) < 1e-5
        rows = cached["blocks.1.mixer.hook_pattern"][:, selection[1]].sum(-1)
        assert torch.allclose(rows, torch.ones(()), atol=1e-5)  # a swapped head: softmax rows
        with swapped.pattern_selection(heads=selection, query_positions=[3, -1]):
            assert _gap(swapped.run_with_hooks(ids, fwd_hooks=hooks), fast) < 1e-5
    assert cached["blocks.1.mixer.hook_pattern"].shape == (2, len(selection), 2, 10)


@pytest.mark.parametrize("which", ["llamba", "mamba2", "hybrid"])
def test_the_step_gives_the_forwards_last_position(which):
    if which == "llamba":
        swapped, _ = _swapped_llamba()
    elif which == "mamba2":
        student, teacher = _mamba2_pair()
        swapped = swap_teacher_heads(student, teacher, [(0, 1), (1, 4), (1, 7)])
    else:
        student, teacher = _hybrid()
        swapped = swap_teacher_heads(student, teacher, [(0, 2), (1, 0)])
    ids = _ids(length=11, seed=5)
    with torch.no_grad():
        full = swapped(ids)
        last, prefix = swapped.prefix_state(ids)
        again = swapped.step(prefix)
        # the sweeps ablate on the step: the same as the full forward's last position
        with ablate_heads(swapped, [(1, 4 if which == "mamba2" else 2)], positions="last"):
            ablated_full = swapped(ids)[:, -1]
            ablated_step = swapped.step(prefix)
    assert _gap(last, full[:, -1]) < 1e-5 and _gap(again, full[:, -1]) < 1e-5
    assert _gap(ablated_full, full[:, -1]) > 1e-4
    assert _gap(ablated_step, ablated_full) < 1e-5


# ----------------------------------------------------------------------------- saving
def test_a_swapped_hybrid_saves_and_loads_back_and_a_swapped_llamba_refuses(tmp_path):
    student, teacher = _hybrid()
    swapped = swap_teacher_heads(student, teacher, [(0, 3)])
    swapped.save_pretrained(tmp_path / "s")
    back = load_model(str(tmp_path / "s"))
    ids = _ids(seed=6)
    with torch.no_grad():
        assert torch.equal(back(ids), swapped(ids))
    assert back.cfg.attention_heads == [[1, 3], [3]]
    assert back.cfg.teacher["head_swap"]["heads"] == [[0, 3]]
    llamba, _ = _swapped_llamba()
    with pytest.raises(ConfigError, match="swap_teacher_heads"):
        llamba.save_pretrained(tmp_path / "l")
    assert not (tmp_path / "l").exists()


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "heads, named",
    [
        ([(2, 0)], "[(2, 0)] out of range"),
        ([(0, 4), (-1, 0)], "[(0, 4), (-1, 0)] out of range"),
        ([(0, 1), (1, 2), (0, 1)], "[(0, 1)] more than once"),
        ([(0, 1.0)], "(0, 1.0)"),
        ([], "heads=[]"),
        ((0, 1), "heads=(0, 1)"),
        ("0,1", "heads='0,1'"),
    ],
    ids=repr,
)
def test_bad_heads_are_refused_naming_them(heads, named):
    student, teacher = _llamba_pair()
    with pytest.raises(ConfigError, match=re.escape(named)):
        swap_teacher_heads(student, teacher, heads)


def test_heads_that_are_attention_already_are_refused_naming_them():
    student, teacher = _hybrid()
    with pytest.raises(ConfigError, match=re.escape("[(1, 3)] are attention heads already")):
        swap_teacher_heads(student, teacher, [(0, 0), (1, 3)])
    llamba, _ = _llamba_pair()
    swapped = swap_teacher_heads(llamba, teacher, [(1, 2)])
    with pytest.raises(ConfigError, match=re.escape("[(1, 2)] are attention heads already")):
        swap_teacher_heads(swapped, teacher, [(1, 2)])
    with pytest.raises(ConfigError, match=re.escape("layer 1 already has attention heads [2]")):
        swap_teacher_heads(swapped, teacher, [(1, 0)])


def test_a_teacher_whose_heads_do_not_line_up_is_refused_naming_both_shapes():
    student, _ = _llamba_pair()
    wide = tiny_hf_model("llama", seed=3, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=re.escape("n_heads=4, d_head=8, d_inner=32")) as err:
        swap_teacher_heads(student, wide, [(0, 0)])
    assert "num_attention_heads=2, head_dim=16" in str(err.value)
    deep = tiny_hf_model("llama", seed=3, num_hidden_layers=3)
    with pytest.raises(ConfigError, match="n_layers=2, d_model=32") as err:
        swap_teacher_heads(student, deep, [(0, 0)])
    assert "num_hidden_layers=3, hidden_size=32" in str(err.value)
    hybrid, _ = _hybrid()
    with pytest.raises(ConfigError, match=re.escape("n_heads=4 (teacher: 2)")):
        swap_teacher_heads(hybrid, wide, [(0, 0)])


def test_students_without_mamba2_heads_and_trained_shared_kv_heads_are_refused():
    _, teacher = _llamba_pair()
    with pytest.raises(ConfigError, match="Mamba1Mixer"):
        swap_teacher_heads(tiny_hooked_ssm("mamba1"), teacher, [(0, 0)])
    with pytest.raises(ConfigError, match=r"swap_teacher_heads\(teacher=HookedSSM of 'mamba2'\)"):
        swap_teacher_heads(_llamba_pair()[0], tiny_hooked_ssm("mamba2"), [(0, 0)])
    # the hybrid's kept head (0, 1) reads KV head 0, whose weights training moved: swapping
    # (0, 0), which reads it too, cannot give (0, 0) the teacher's keys; (0, 2) can
    student, teacher = _hybrid()
    trained = copy.deepcopy(student)
    with torch.no_grad():
        trained.blocks[0].mixer.k_proj.weight.add_(0.1)
    with pytest.raises(ConfigError, match=re.escape("heads [(0, 0)] read the teacher's KV head 0")):
        swap_teacher_heads(trained, teacher, [(0, 0)])
    assert head_view(swap_teacher_heads(trained, teacher, [(0, 2)])).kind_of((0, 2)) == "attention"


def test_state_bytes_counts_teacher_heads_as_a_kv_cache():
    """A Llamba with teacher heads keeps their keys and values (growing) instead of their SSM
    states (no output norm reads them)."""
    from gna_lens.models.state import state_bytes

    student, teacher = _llamba_pair()
    swapped = swap_teacher_heads(student, teacher, [(0, 1), (1, 2)])
    before = state_bytes(student, (1, 100))
    after = state_bytes(swapped, (1, 100))
    cfg = student.cfg
    assert (after.attention_heads, after.ssm_heads) == (2, 2 * cfg.n_heads - 2)
    per_head = cfg.d_head * cfg.d_state * before.element_bytes
    assert after.recurrent_bytes == before.recurrent_bytes - 2 * per_head
    assert after.kv_bytes_per_token == 2 * 2 * cfg.d_head * before.element_bytes  # 1 KV head each
