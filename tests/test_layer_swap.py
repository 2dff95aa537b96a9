"""gna_lens.hybrid.swap_layers: a student's layers replaced by its teacher's attention layers.

Checked here: swapping every layer's mixer of a student built from the teacher (which has the
teacher's embeddings, norms and MLPs) gives the teacher's logits, for every form of teacher;
swapping every whole block does so even when the student's norms and MLPs are its own, for a
hybrid student and for a Mamba-2 student (whose layers become attention layers); one swapped
layer changes only what follows it; the inputs are never modified; the swapped heads are
attention heads to head_view, hooks, ablation and the incremental step; a swapped hybrid student
saves and loads back; bad layers, parts, teachers and shapes are refused naming what was passed.
"""

import copy
import functools
import re

import pytest
import torch
from interventions_helpers import hook_count

from gna_lens.errors import ConfigError
from gna_lens.heads import head_view
from gna_lens.hybrid import build_hybrid, swap_layers
from gna_lens.hybrid._distill import teacher_twin
from gna_lens.interventions import ablate_heads
from gna_lens.models import HookedSSM, load_model
from gna_lens.testing import tiny_checkpoint, tiny_hf_model, tiny_hooked_ssm

#: Teacher configs: grouped-query heads; full heads with attention and MLP biases and a scaled
#: RoPE (every bias and the RoPE variant have to travel).
CONFIGS = {
    "gqa": {},
    "mha-biases-linear-rope": {
        "num_key_value_heads": 4,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
    },
}


#: Bamba rotates half of each head by default; the Llama teacher rotates all of it.
FULL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


def _ids(length: int = 19, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(2, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@functools.cache
def _teacher(config: str = "gqa", n_layers: int = 2):
    return tiny_hf_model("llama", seed=3, num_hidden_layers=n_layers, **CONFIGS[config])


@functools.cache
def _student(config: str = "gqa", n_layers: int = 2) -> HookedSSM:
    """Every head an SSM head: no layer computes what the teacher's does."""
    return build_hybrid(_teacher(config, n_layers), [], d_state=8)


def _own_norms_and_mlps(student: HookedSSM) -> HookedSSM:
    """A copy of ``student`` whose norms and MLPs are no longer the teacher's."""
    other = copy.deepcopy(student)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.startswith("blocks.") and (".ln" in name or ".mlp." in name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return other


def _teacher_form(form: str, tmp_path):
    """(the teacher in ``form``, the Hugging Face model whose logits it has)."""
    if form in ("hf", "twin"):
        hf = _teacher()
        return (hf if form == "hf" else teacher_twin(hf)), hf
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint("llama", tmp_path / "teacher", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    if form == "folder":
        return folder, hf
    return TransformerBridge.boot_transformers(str(folder)), hf


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("form", ["hf", "bridge", "folder", "twin"])
def test_every_mixer_swapped_gives_the_teachers_logits(form, tmp_path):
    teacher, hf = _teacher_form(form, tmp_path)
    student = build_hybrid(hf, [], d_state=8)
    swapped = swap_layers(student, teacher, [0, 1])
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        assert _gap(student(ids), ref) > 1e-2  # the student alone is not the teacher
        assert _gap(swapped(ids), ref) < 1e-4
        # the materialized path (hook_pattern hooked) too
        out = swapped.run_with_hooks(
            ids, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda t, hook: t)]
        )
    assert _gap(out, ref) < 1e-4


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_block_swapped_gives_the_teacher_whatever_the_students_norms_and_mlps(config):
    hf = _teacher(config)
    student = _own_norms_and_mlps(_student(config))
    ids = _ids(seed=1)
    with torch.no_grad():
        ref = hf(ids).logits
        mixers_only = swap_layers(student, hf, [0, 1], part="mixer")(ids)
        blocks = swap_layers(student, hf, [0, 1], part="block")(ids)
    assert _gap(mixers_only, ref) > 1e-2  # the student's own norms and MLPs stayed
    assert _gap(blocks, ref) < 1e-4


def _pair(student: HookedSSM, **overrides):
    """``student`` and a Llama teacher of its shape sharing its embeddings, final norm and
    unembedding (so that a model of the teacher's blocks has the teacher's logits)."""
    cfg = student.cfg
    hf = tiny_hf_model(
        "llama",
        seed=5,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        vocab_size=cfg.d_vocab,
        rms_norm_eps=cfg.eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **overrides,
    )
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(student.embed.weight)
        hf.model.norm.weight.copy_(student.ln_final.weight)
        hf.lm_head.weight.copy_(student.unembed.weight)
    return student, hf


def _mamba2_pair(**overrides):
    """A tiny Mamba-2 HookedSSM (no MLPs) and its :func:`_pair` teacher."""
    return _pair(tiny_hooked_ssm("mamba2"), **overrides)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_mamba2_student_with_every_block_swapped_is_the_teacher(config):
    student, hf = _mamba2_pair(**CONFIGS[config])
    swapped = swap_layers(student, hf, [0, 1], part="block")
    ids = _ids(seed=2)
    with torch.no_grad():
        ref = hf(ids).logits
        assert _gap(student(ids), ref) > 1e-2
        assert _gap(swapped(ids), ref) < 1e-4
    assert swapped.cfg.layer_types == ["attention", "attention"]


def test_a_hybrid_with_its_own_attention_and_mlps_keeps_them_or_takes_the_teachers():
    """Bamba (Mamba-2 and attention layers, an MLP in every block): ``part="mixer"`` keeps the
    student's norms and MLPs around the teacher's attention, ``part="block"`` takes the
    teacher's."""
    student, hf = _pair(_own_norms_and_mlps(tiny_hooked_ssm("bamba", rope_parameters=FULL_ROPE)))
    everything = list(range(student.cfg.n_layers))
    own = copy.deepcopy(hf)  # the teacher with the student's norms and MLPs
    with torch.no_grad():
        for layer, block in zip(own.model.layers, student.blocks, strict=True):
            layer.input_layernorm.load_state_dict(block.ln1.state_dict())
            layer.post_attention_layernorm.load_state_dict(block.ln2.state_dict())
            layer.mlp.load_state_dict(block.mlp.state_dict())
        ids = _ids(seed=7)
        ref, ref_own = hf(ids).logits, own(ids).logits
        assert _gap(ref, ref_own) > 1e-2
        assert _gap(swap_layers(student, hf, everything, part="block")(ids), ref) < 1e-4
        assert _gap(swap_layers(student, hf, everything, part="mixer")(ids), ref_own) < 1e-4


# ----------------------------------------------------------------------------- one layer
def test_one_swapped_layer_changes_only_what_follows_it():
    student = _student("gqa", n_layers=3)
    swapped = swap_layers(student, _teacher("gqa", n_layers=3), 1)
    ids = _ids(seed=3)
    with torch.no_grad():
        _, before = student.run_with_cache(ids)
        _, after = swapped.run_with_cache(ids)
    for layer in (0, 1):
        name = f"blocks.{layer}.hook_resid_pre"
        assert torch.equal(after[name], before[name]), name
    assert _gap(after["blocks.1.hook_mixer_out"], before["blocks.1.hook_mixer_out"]) > 1e-3
    assert _gap(after["blocks.2.hook_resid_post"], before["blocks.2.hook_resid_post"]) > 1e-3
    # layer 1 is the teacher twin's layer: every head attention, in the one hook_pattern
    view = head_view(swapped)
    assert [view.kind(i) for i in range(3)] == ["ssm", "attention", "ssm"]
    assert head_view(student).kind(1) == "ssm"
    pattern = after["blocks.1.mixer.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)  # softmax rows
    record = swapped.gna_layer_swap
    assert (record["layers"], record["part"], type(record["teacher"])) == ([1], "mixer", str)
    assert swapped.cfg.attention_heads == [[], [0, 1, 2, 3], []]


def test_a_mamba2_layer_becomes_an_attention_layer_of_the_usual_hooks():
    student, hf = _mamba2_pair()
    swapped = swap_layers(student, hf, [1])
    ids = _ids(length=11, seed=4)
    with torch.no_grad():
        logits, cache = swapped.run_with_cache(ids)
        _, before = student.run_with_cache(ids)
    assert torch.equal(cache["blocks.1.hook_resid_pre"], before["blocks.1.hook_resid_pre"])
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, 4, 11, 11)
    assert cache["blocks.1.attn.hook_z"].shape == (2, 11, 4, 8)
    assert "blocks.1.mixer.hook_pattern" not in swapped.hook_dict
    view = head_view(swapped)
    assert (view.kind(0), view.kind(1), view[1].n_heads) == ("ssm", "attention", 4)
    # the incremental step (the sweeps' last-position path) runs the new layer too
    with torch.no_grad():
        last, prefix = swapped.prefix_state(ids)
        again = swapped.step(prefix)
    assert _gap(last, logits[:, -1]) < 1e-5 and _gap(again, last) < 1e-5


# ----------------------------------------------------------------------------- the inputs
def test_the_student_and_the_teacher_are_not_modified():
    hf = _teacher()
    hybrid = _own_norms_and_mlps(_student())
    mamba2, teacher2 = _mamba2_pair()
    for student, teacher in ((hybrid, hf), (mamba2, teacher2)):
        weights = {k: v.clone() for k, v in student.state_dict().items()}
        teacher_weights = {k: v.clone() for k, v in teacher.state_dict().items()}
        cfg = copy.deepcopy(student.cfg)
        for part in ("mixer", "block"):
            swapped = swap_layers(student, teacher, [0, 1], part=part)
            assert swapped is not student and swapped.cfg is not student.cfg
            with torch.no_grad():  # the new model shares no tensor with either input
                for p in swapped.parameters():
                    p.add_(1.0)
        assert student.cfg == cfg
        assert not hasattr(student, "gna_layer_swap")
        for k, v in student.state_dict().items():
            assert torch.equal(v, weights[k]), k
        for k, v in teacher.state_dict().items():
            assert torch.equal(v, teacher_weights[k]), k
    assert "rope_inv_freq" not in mamba2._buffers  # the Mamba-2 student still has no RoPE
    assert head_view(mamba2).kind(1) == "ssm"


# ----------------------------------------------------------------------------- interventions
@pytest.mark.parametrize("which", ["hybrid", "mamba2"])
def test_ablating_a_swapped_head_changes_the_logits_and_is_undone(which):
    if which == "hybrid":
        swapped = swap_layers(_student(), _teacher(), [1])
    else:
        student, teacher = _mamba2_pair()
        swapped = swap_layers(student, teacher, [1])
    ids = _ids(seed=5)
    with torch.no_grad():
        clean = swapped(ids)
        with ablate_heads(swapped, [(1, 2)]):
            ablated = swapped(ids)
        again = swapped(ids)
    assert _gap(ablated, clean) > 1e-4
    assert torch.equal(again, clean)
    assert hook_count(swapped) == 0


def test_a_swapped_hybrid_student_saves_and_loads_back(tmp_path):
    swapped = swap_layers(_student(), _teacher(), [0], part="block")
    swapped.save_pretrained(tmp_path / "s")
    back = load_model(str(tmp_path / "s"))
    ids = _ids(seed=6)
    with torch.no_grad():
        assert torch.equal(back(ids), swapped(ids))
    assert back.cfg.attention_heads == [[0, 1, 2, 3], []]
    assert back.cfg.teacher["layer_swap"]["layers"] == [0]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "layers", [[2], [-1], [0, 0], ["1"], [1.0], [True], [], "1", None], ids=repr
)
def test_bad_layers_are_refused_naming_them(layers):
    with pytest.raises(ConfigError, match=re.escape(f"layers={layers!r}")):
        swap_layers(_student(), _teacher(), layers)


def test_a_bad_part_is_refused():
    with pytest.raises(ConfigError, match=re.escape("part='attention'")):
        swap_layers(_student(), _teacher(), [0], part="attention")


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"num_hidden_layers": 3}, "num_hidden_layers=3, hidden_size=32"),
        ({"hidden_size": 48}, "num_hidden_layers=2, hidden_size=48"),
    ],
)
def test_a_teacher_of_another_shape_is_refused_naming_both_shapes(overrides, named):
    teacher = tiny_hf_model("llama", seed=3, **overrides)
    for student in (_student(), tiny_hooked_ssm("mamba2")):
        with pytest.raises(ConfigError, match="n_layers=2, d_model=32") as err:
            swap_layers(student, teacher, [0])
        assert named in str(err.value)


def test_teachers_that_are_not_llama_style_are_refused():
    with pytest.raises(ConfigError, match="model_type='mamba2'"):
        swap_layers(_student(), tiny_hf_model("mamba2"), [0])
    with pytest.raises(ConfigError, match="not a teacher twin"):
        swap_layers(_student(), build_hybrid(_teacher(), [(0, 1)], d_state=8), [0])
    with pytest.raises(ConfigError, match="HookedSSM of 'mamba2'"):
        swap_layers(_student(), tiny_hooked_ssm("mamba2"), [0])


def test_attention_of_another_shape_is_refused():
    """Same width and depth, other heads: the hybrid student's one config (and a hybrid's own
    attention layers) cannot hold them."""
    teacher = tiny_hf_model("llama", seed=3, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=re.escape("n_heads=4 (teacher: 2)")):
        swap_layers(_student(), teacher, [0])
    bamba = tiny_hooked_ssm("bamba", num_hidden_layers=2, attn_layer_indices=[1])
    with pytest.raises(ConfigError, match=re.escape("n_attn_heads=4 (teacher: 2)")):
        swap_layers(bamba, teacher, [0])
