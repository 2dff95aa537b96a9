"""Llamba (Cartesia's DiscreteMamba2 models) in HookedSSM: parity with an independent float64
per-token reference, the implicit attention and its edits, per-head ablation, the step, and
loading Cartesia's checkpoint layout (folder, hub name, shards, errors, saving, scanning).

Cartesia's own code needs a GPU and Triton kernels, so the reference here is written from the
published description: a plain per-token recurrence in float64 over the checkpoint's weights
under Cartesia's names (never through HookedSSM's modules)."""

import json

import pytest
import torch
import torch.nn.functional as F
from interventions_helpers import hook_count, tokens
from interventions_helpers import model as helper_model
from interventions_helpers import task as make_task

import gna_lens.interventions as I
from gna_lens import head_view, load_model
from gna_lens.errors import ConfigError
from gna_lens.models import HookedSSM, provenance_of
from gna_lens.models.families import llamba
from gna_lens.testing import (
    tiny_checkpoint,
    tiny_hooked_ssm,
    tiny_llamba_config,
    tiny_llamba_state,
    tiny_tokenizer,
)

COMMIT = "c" * 40
#: Two shapes: 4 value heads sharing 2 B/C heads (identity convolution activation, z_bias, an
#: untied LM head); 4 value heads of 16 with 4 B/C heads (expand 2, SiLU, biases, tied head).
SHAPES = {
    "qk<v": {},
    "qk=v": {
        "ssm_cfg": {"n_qk_heads": 4, "expand": 2, "activation": "silu", "bias": True},
        "tie_embeddings": True,
    },
}


def reference_logits(config, state, ids):
    """Llamba's forward pass token by token in float64, from Cartesia's config and weights."""
    st = {k: v.double() for k, v in state.items()}
    ssm, d = config["ssm_cfg"], config["d_model"]
    E = ssm.get("d_inner") or ssm.get("expand", 1) * d
    H, G, N = ssm["n_v_heads"], ssm["n_qk_heads"], ssm["d_state"]
    P, K, share = E // H, ssm.get("d_conv", 4), H // G

    def rms(v, w):
        return w * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    def lin(v, name):
        out = v @ st[name + ".weight"].T
        return out + st[name + ".bias"] if name + ".bias" in st else out

    b, L = ids.shape
    resid = st["backbone.embedding.weight"][ids]
    for layer in range(config["n_layer"]):
        p = f"backbone.layers.{layer}."
        proj = lin(rms(resid, st[p + "input_layernorm.weight"]), p + "mixer.in_proj")
        cd = E + 2 * G * N
        xBC, z, a = proj[..., :cd], proj[..., cd : cd + E], proj[..., cd + E :]
        w = st[p + "mixer.conv1d.weight"][:, 0]
        conv = torch.zeros_like(xBC)
        for t in range(L):
            for k in range(K):
                if t - (K - 1) + k >= 0:
                    conv[:, t] += w[:, k] * xBC[:, t - (K - 1) + k]
        conv = conv + st.get(p + "mixer.conv1d.bias", 0.0)
        if ssm.get("activation") == "silu":
            conv = F.silu(conv)
        x = conv[..., :E].reshape(b, L, H, P)
        B = conv[..., E : E + G * N].reshape(b, L, G, N)
        C = conv[..., E + G * N :].reshape(b, L, G, N)
        dt = F.softplus(a)
        h = torch.zeros(b, H, P, N, dtype=torch.float64)
        ys = []
        for t in range(L):
            y_t = []
            for hd in range(H):
                g = hd // share
                h[:, hd] = torch.exp(-dt[:, t, hd])[:, None, None] * h[:, hd] + (
                    x[:, t, hd, :, None] * B[:, t, g, None, :]
                )
                y_t.append(torch.einsum("bpn,bn->bp", h[:, hd], C[:, t, g]))
            ys.append(torch.stack(y_t, 1) + st[p + "mixer.D"][:, None] * x[:, t])
        y = torch.stack(ys, 1).reshape(b, L, E)
        gate = z + st[p + "mixer.z_bias"] if p + "mixer.z_bias" in st else z
        resid = resid + lin(y * F.silu(gate), p + "mixer.out_proj")
        u = rms(resid, st[p + "post_attention_layernorm.weight"])
        up = F.silu(lin(u, p + "mlp.gate_proj")) * lin(u, p + "mlp.up_proj")
        resid = resid + lin(up, p + "mlp.down_proj")
    out = rms(resid, st["backbone.final_layernorm.weight"])
    return out @ st.get("lm_head.weight", st["backbone.embedding.weight"]).T


def _ids(b=2, L=21, seed=1):
    return torch.randint(2, 317, (b, L), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """A random Cartesia-layout checkpoint, loaded through load_model, with its config and
    weights."""
    overrides = SHAPES[request.param]
    folder = tiny_checkpoint("llamba", tmp_path_factory.mktemp(request.param), seed=3, **overrides)
    config = tiny_llamba_config(**overrides)
    return load_model(folder, device="cpu"), config, tiny_llamba_state(config, seed=3)


def test_logits_match_the_float64_reference_on_every_path(pair):
    model, config, state = pair
    assert isinstance(model, HookedSSM) and model.cfg.architecture == "llamba"
    ssm = config["ssm_cfg"]
    assert (model.cfg.n_heads, model.cfg.n_groups) == (ssm["n_v_heads"], ssm["n_qk_heads"])
    ids = _ids()  # 21 positions: chunks of 8 plus a remainder
    ref = reference_logits(config, state, ids)
    with torch.no_grad():
        fast = model(ids)
        assert model.blocks[0].mixer.last_path["scan"] == "torch.ssd"
        mat = model.run_with_hooks(
            ids, fwd_hooks=[(lambda n: "hook_pattern" in n, lambda p, hook: p)]
        )
        assert model.blocks[0].mixer.last_path["scan"] == "materialized"
        rec = model.run_with_hooks(
            ids, fwd_hooks=[(lambda n: "hook_ssm_state" in n, lambda s, hook: s)]
        )
        assert model.blocks[0].mixer.last_path["scan"] == "torch.recurrent"
    for out in (fast, mat, rec):
        assert (out.double() - ref).abs().max().item() < 1e-5


def test_pattern_is_the_decayed_c_dot_b_and_edits_change_the_output_as_predicted(pair):
    model, _, _ = pair
    ids = _ids(2, 15, 2)
    pre = "blocks.1.mixer."
    names = [pre + n for n in ("hook_pattern", "hook_ssm_input", "hook_ssm_dt", "hook_ssm_B",
                               "hook_ssm_C", "hook_gate", "hook_ssm_out")]  # fmt: skip
    with torch.no_grad():
        clean, cache = model.run_with_cache(ids, names_filter=names)
    M, x, dt, B, C, gate, out = (cache[n].double() for n in names)
    H, G = model.cfg.n_heads, model.cfg.n_groups
    # M[b,h,i,j] = (C_i . B_j) exp(-sum_{k=j+1..i} dt_k): written out in float64, no dt_j.
    cs = dt.cumsum(1)  # [b, L, H]
    decay = torch.exp(-(cs[:, :, None, :] - cs[:, None, :, :])).permute(0, 3, 1, 2)
    decay = decay * torch.ones(15, 15, dtype=torch.float64).tril()
    CB = torch.einsum("bign,bjgn->bgij", C, B).repeat_interleave(H // G, dim=1)
    assert (M - CB * decay).abs().max().item() < 1e-5
    mixer = model.blocks[1].mixer
    D = mixer.D.detach().double()
    assert (torch.einsum("bhij,bjhp->bihp", M, x) + x * D[:, None] - out).abs().max() < 1e-5

    # Edit: head 1 reads only keys 0..3 at every query. The layer's output must be the one the
    # edited matrix gives through D, the gate and out_proj.
    def edit(p, hook):
        p[:, 1, :, 4:] = 0.0
        return p

    seen = {}
    with torch.no_grad():
        edited = model.run_with_hooks(
            ids,
            fwd_hooks=[(pre + "hook_pattern", edit),
                       ("blocks.1.hook_mixer_out", lambda t, hook: seen.setdefault("o", t))],
        )  # fmt: skip
    M2 = M.clone()
    M2[:, 1, :, 4:] = 0.0
    y = torch.einsum("bhij,bjhp->bihp", M2, x) + x * D[:, None]
    y = y.reshape(*y.shape[:2], -1) * F.silu(gate)
    W = mixer.out_proj.weight.detach().double()
    predicted = y @ W.T + (0 if mixer.out_proj.bias is None else mixer.out_proj.bias.double())
    assert (seen["o"].double() - predicted).abs().max().item() < 1e-5
    assert (edited - clean).abs().max().item() > 1e-3


def test_head_ablation_equals_zeroing_its_slice_before_out_proj(pair):
    model, _, _ = pair
    ids = _ids(2, 12, 3)
    P = model.cfg.d_head
    for layer, head in [(0, 0), (1, 3), (1, 1)]:

        def zero_slice(module, args, head=head):
            (inp,) = args
            inp = inp.clone()
            inp[..., head * P : (head + 1) * P] = 0.0
            return (inp,)

        handle = model.blocks[layer].mixer.out_proj.register_forward_pre_hook(zero_slice)
        try:
            with torch.no_grad():
                by_hand = model(ids)
        finally:
            handle.remove()
        with torch.no_grad(), I.ablate_heads(model, [(layer, head)]):
            ablated = model(ids)
        with torch.no_grad():
            clean = model(ids)
        assert (ablated - by_hand).abs().max().item() < 1e-5
        assert (ablated - clean).abs().max().item() > 1e-3
    assert head_view(model)[1].n_heads == model.cfg.n_heads


def test_step_reproduces_the_last_position(pair):
    model, _, _ = pair
    ids = _ids(3, 17, 4)
    with torch.no_grad():
        logits, prefix = model.prefix_state(ids)
        again = model.step(prefix)
        full = model(ids)[:, -1]
    assert (again - full).abs().max().item() < 1e-5
    assert (logits - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode,positions", [("zero", None), ("mean", "last")])
def test_batched_sweep_equals_a_loop_of_single_ablations(mode, positions):
    from gna_lens.interventions.metrics import Metric

    m = helper_model("llamba")
    t = make_task()
    ref = None if mode == "zero" else make_task(seed=5)
    before = hook_count(m)
    res = I.ablation_sweep(
        m, t, "logit_diff", mode=mode, positions=positions, reference=ref, pack=3, progress=False
    )
    ids, idx, met = tokens(t), torch.arange(len(t)), Metric("logit_diff", t)
    loop = []
    with torch.no_grad():
        for head in head_view(m).heads():
            with I.ablate_heads(m, [head], mode=mode, positions=positions, reference=ref):
                loop.append(met(m(ids)[:, -1], idx))
    assert (res.values - torch.stack(loop)).abs().max().item() <= 1e-5
    assert res.effects.abs().max() > 1e-3
    if positions == "last":
        assert res.method == "incremental", res.info
    assert hook_count(m) == before


# ----------------------------------------------------------------------------- loading
def _state_of(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_cartesia_folders_load_with_or_without_model_type_bin_or_shards(tmp_path):
    base = tiny_checkpoint("llamba", tmp_path / "base", seed=5)
    ids = _ids(1, 9, 5)
    with torch.no_grad():
        expected = load_model(base)(ids)
    prov = provenance_of(load_model(base))
    assert (prov.source, prov.format, prov.stored_dtype) == ("local", "cartesia", "float32")
    assert prov.files[0][0] == "model.safetensors"
    state = _state_of(base)
    config = json.loads((base / "config.json").read_text())
    assert "model_type" not in config  # as Cartesia's PyTorchModelHubMixin writes it

    typed = tiny_checkpoint("llamba", tmp_path / "typed", seed=5)
    (typed / "config.json").write_text(json.dumps({**config, "model_type": "llamba"}))
    binary = tiny_checkpoint("llamba", tmp_path / "bin", seed=5)
    (binary / "model.safetensors").unlink()
    torch.save(state, binary / "pytorch_model.bin")
    sharded = tiny_checkpoint("llamba", tmp_path / "shards", seed=5)
    (sharded / "model.safetensors").unlink()
    from safetensors.torch import save_file

    keys = sorted(state)
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(sharded / name))
    weight_map = {k: name for name, part in halves.items() for k in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for folder in (typed, binary, sharded):
        with torch.no_grad():
            assert torch.equal(load_model(folder)(ids), expected), folder.name
        assert HookedSSM.from_pretrained(str(folder)).cfg.architecture == "llamba"


def test_a_hub_name_is_fetched_with_the_llama_tokenizer_it_names(tmp_path, monkeypatch):
    import huggingface_hub
    import transformers

    from gna_lens.models import gguf

    snapshot = tmp_path / "snapshots" / COMMIT
    tiny_checkpoint("llamba", snapshot, seed=6)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (snapshot / f).unlink(missing_ok=True)  # Llamba repositories ship no tokenizer
    asked, tokenizers = [], []

    def fake_download(repo_id, filename, revision=None, local_files_only=False, **_):
        asked.append((repo_id, filename))
        if not (snapshot / filename).is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(snapshot / filename)

    real = transformers.AutoTokenizer.from_pretrained

    def fake_tokenizer(name, *args, **kwargs):
        if str(name).startswith("meta-llama/"):
            tokenizers.append(name)
            return tiny_tokenizer()
        return real(name, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tokenizer)
    monkeypatch.setattr(gguf, "hub_reachable", lambda timeout=1.5: True)
    model = load_model("cartesia-ai/Llamba-3B")
    assert ("cartesia-ai/Llamba-3B", "config.json") in asked
    assert ("cartesia-ai/Llamba-3B", "model.safetensors") in asked
    assert tokenizers == ["meta-llama/Llama-3.2-3B"] and model.tokenizer is not None
    prov = provenance_of(model)
    assert (prov.source, prov.format, prov.revision) == ("hub", "cartesia", COMMIT)
    assert prov.tokenizer == "meta-llama/Llama-3.2-3B" and prov.location == "cartesia-ai/Llamba-3B"
    with torch.no_grad():
        expected = load_model(snapshot, tokenizer=tiny_tokenizer())(_ids(1, 7))
        assert torch.equal(model(_ids(1, 7)), expected)


def test_save_pretrained_writes_cartesia_names_and_reads_back_bit_identically(tmp_path):
    for overrides in SHAPES.values():
        model = tiny_hooked_ssm("llamba", seed=7, **overrides)
        folder = model.save_pretrained(tmp_path / str(len(overrides)))
        written = set(_state_of(folder))
        assert written == set(tiny_llamba_state(tiny_llamba_config(**overrides)))
        again = load_model(folder)
        with torch.no_grad():
            assert torch.equal(again(_ids(1, 11)), model(_ids(1, 11)))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"lm_head_bias": True}, "lm_head_bias=true"),
        ({"norm_epsilon": 1e-6}, "norm_epsilon=1e-06"),
        ({"ssm_cfg": {"activation": "gelu"}}, "activation='gelu'"),
        ({"ssm_cfg": {"n_qk_heads": 3}}, "n_qk_heads=3"),
    ],
)
def test_unsupported_options_are_refused_naming_them(tmp_path, change, match):
    folder = tiny_checkpoint("llamba", tmp_path, seed=0)
    config = tiny_llamba_config(**change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        load_model(folder)


def test_missing_or_unknown_weights_are_refused_naming_them(tmp_path):
    from safetensors.torch import save_file

    folder = tiny_checkpoint("llamba", tmp_path / "a", seed=0)
    state = _state_of(folder)
    state["backbone.layers.0.mixer.A_log"] = torch.zeros(4)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"backbone\.layers\.0\.mixer\.A_log"):
        load_model(folder)
    del state["backbone.layers.0.mixer.A_log"], state["backbone.layers.1.mixer.D"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['backbone\.layers\.1\.mixer\.D'\]"):
        load_model(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="without weights"):
        load_model(folder)


def test_a_mamba_ssm_config_is_not_taken_for_llamba():
    from gna_lens.models.convert_mamba_ssm import is_mamba_ssm_config

    config = tiny_llamba_config()
    assert llamba.is_llamba_config(config) and not is_mamba_ssm_config(config)
    mamba_ssm = {"d_model": 64, "n_layer": 2, "vocab_size": 320, "ssm_cfg": {"layer": "Mamba2"}}
    assert is_mamba_ssm_config(mamba_ssm) and not llamba.is_llamba_config(mamba_ssm)


def test_scan_cli_ranks_the_heads_of_a_cartesia_checkpoint(tmp_path, capsys):
    from gna_lens.cli import main
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    words = load_words()[:40]
    tok = word_tokenizer(
        ["Below is a list of key-value pairs. What is the value for key ? :",
         "Memorize the following dictionary: The value of the key ' is", " ".join(words)],
        bos=True,
    )  # fmt: skip
    folder = tiny_checkpoint("llamba", tmp_path / "ckpt", seed=8, vocab_size=len(tok))
    tok.save_pretrained(str(folder))
    out = tmp_path / "report"
    args = ["scan", str(folder), "--n-samples", "6", "--n-eval", "6", "--top", "2",
            "--control", "none", "--random-draws", "2", "--out", str(out), "--force"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr()
    data = json.loads((out / "report.json").read_text())
    assert data["layer_heads"] == [4, 4] and len(data["heads"]) == 8
    assert data["n_exact"] == 8
    assert data["provenance"]["format"] == "cartesia"


# ----------------------------------------------------------------------------- layer swaps
def _teacher_and_student(tmp_path, seed=9):
    """A tiny Llama teacher and a Llamba checkpoint (Cartesia's layout) of its shape whose
    embeddings, norms, MLPs and LM head are the teacher's (as MOHAWK's student starts): only the
    mixers differ."""
    from safetensors.torch import save_file

    from gna_lens.testing import tiny_hf_model

    teacher = tiny_hf_model("llama", seed=seed, rms_norm_eps=1e-5)
    config = tiny_llamba_config()
    state = tiny_llamba_state(config, seed=seed)
    w = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
    state["backbone.embedding.weight"] = w["model.embed_tokens.weight"]
    state["backbone.final_layernorm.weight"] = w["model.norm.weight"]
    state["lm_head.weight"] = w["lm_head.weight"]
    for layer in range(2):
        src, dst = f"model.layers.{layer}.", f"backbone.layers.{layer}."
        for name in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ):
            state[dst + name] = w[src + name]  # fmt: skip
    folder = tiny_checkpoint("llamba", tmp_path / "student", seed=seed)
    save_file(state, str(folder / "model.safetensors"))
    return teacher, load_model(folder)


def test_swapping_every_llamba_layer_for_the_teachers_attention_gives_the_teachers_logits(
    tmp_path,
):
    from gna_lens.hybrid import swap_layers

    teacher, student = _teacher_and_student(tmp_path)
    ids = _ids(2, 13, 9)
    with torch.no_grad():
        want = teacher(ids).logits
        assert (student(ids) - want).abs().max().item() > 1e-2  # the mixers differ
        one = swap_layers(student, teacher, [1])  # the paper's "layer 17 -> attention", small
        swapped = swap_layers(student, teacher, [0, 1])
        assert (swapped(ids) - want).abs().max().item() < 1e-4
        assert (one(ids) - want).abs().max().item() > 1e-4
    assert [head_view(one)[i].kind for i in (0, 1)] == ["ssm", "attention"]
    assert head_view(one)[1].n_heads == 4
    assert one.cfg.architecture == "llamba" and student.cfg.layer_types == ["ssm", "ssm"]
    with pytest.raises(ConfigError, match="attention"):
        one.save_pretrained(tmp_path / "swapped")  # Cartesia's layout has no attention layers


# ----------------------------------------------------------------------------- the comparison
def test_evaluate_compares_a_llama_and_a_llamba_with_state_sizes(tmp_path, capsys):
    """``gna-lens evaluate A B``, offline, on a tiny Llama and a random Llamba (both over a word
    tokenizer): one table per model with its own heads removed and random rows, side by side,
    and each model's state size counted from its shape."""
    pytest.importorskip("lm_eval")
    from gna_lens.cli import main
    from gna_lens.tasks import load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    words = load_words()[:40]
    tok = word_tokenizer(
        ["Below is a list of key-value pairs. What is the value for key ? : Answer",
         " ".join(words)],
        bos=True,
    )  # fmt: skip
    llama = tiny_checkpoint("llama", tmp_path / "tiny-llama", seed=1, vocab_size=len(tok))
    llamba_dir = tiny_checkpoint("llamba", tmp_path / "tiny-llamba", seed=1, vocab_size=len(tok))
    for folder in (llama, llamba_dir):
        tok.save_pretrained(str(folder))
    rankings = []
    for name, heads in (("a", [[1, 0], [0, 1], [1, 3]]), ("b", [[0, 2], [1, 1], [0, 0]])):
        (tmp_path / f"{name}.json").write_text(json.dumps(heads))
        rankings += ["--ranking", str(tmp_path / f"{name}.json")]
    out = tmp_path / "cmp"
    args = ["evaluate", str(llama), str(llamba_dir), "--tasks", "gna_kv", "--remove-top", "0,2",
            "--random-draws", "2", "--random-k", "2", "--limit", "16", *rankings,
            "--state-lengths", "128,4096", "--out", str(out), "--quiet", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    text = (out / "comparison.md").read_text()
    for needle in ("tiny-llama", "tiny-llamba", "| 2 |", "random-2 #1", "random-2 mean",
                   "State kept per sequence", "total at 4,096 tokens"):  # fmt: skip
        assert needle in text, needle
    assert {p.name for p in out.iterdir()} >= {"comparison.json", "state.csv", "tiny-llama",
                                               "tiny-llamba"}  # fmt: skip
    assert (out / "tiny-llamba" / "table.md").is_file()
    import pandas as pd

    state = pd.read_csv(out / "state.csv").set_index(["model", "length"])
    # bfloat16 (2 bytes): Llamba 2 layers x (4 heads x 8 x 8 state + 3 x 64 conv channels);
    # the Llama: 2 layers x 2 KV heads x (8 + 8) per token.
    llamba_row = state.loc[(str(llamba_dir), 4096)]
    assert llamba_row["recurrent_bytes"] == 2 * 2 * (4 * 8 * 8 + 3 * 64)
    assert llamba_row["kv_cache_bytes"] == 0
    llama_row = state.loc[next(i for i in state.index if i[0] != str(llamba_dir) and i[1] == 4096)]
    assert llama_row["kv_cache_bytes"] == 4096 * 2 * 2 * 2 * 16
    data = json.loads((out / "comparison.json").read_text())
    assert [t["ranking"][:2] for t in data["tables"]] == [[[1, 0], [0, 1]], [[0, 2], [1, 1]]]


def test_state_bytes_reproduces_the_papers_llama_3_2_1b_row():
    """The paper's state-size table: Llama-3.2-1B keeps 4.2 / 67.1 / 134.2 MB at 128 / 2048 /
    4096 tokens (bfloat16 KV cache). Built on the meta device from its published shape."""
    import transformers as tf

    from gna_lens.models.state import state_bytes
    from gna_lens.render.markdown import format_bytes

    cfg = tf.LlamaConfig(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256,
    )  # fmt: skip
    with torch.device("meta"):
        llama = tf.LlamaForCausalLM(cfg)
    sb = state_bytes(llama, (128, 2048, 4096), dtype=torch.bfloat16)
    assert [format_bytes(sb.total_bytes(L)) for L in (128, 2048, 4096)] == [
        "4.2 MB", "67.1 MB", "134.2 MB",
    ]  # fmt: skip
    # A Llamba's state does not grow: per layer, heads x head dim x state + the convolution
    # window (d_conv - 1) x (d_inner + 2 n_qk_heads d_state).
    model = tiny_hooked_ssm("llamba")
    sb = state_bytes(model, (128, 4096), dtype=torch.bfloat16)
    assert sb.total_bytes(128) == sb.total_bytes(4096) == 2 * 2 * (4 * 8 * 8 + 3 * (32 + 2 * 2 * 8))


@pytest.mark.parametrize("arch", ["llamba", "mamba2"])
def test_a_bfloat16_model_runs_the_torch_scan_and_stays_near_float32(arch):
    """Loaded in bfloat16 (as the recipe's GPU run), the chunked SSD scan works in float32
    inside (A is float32; it failed on a dtype mismatch before) and returns bfloat16."""
    model = tiny_hooked_ssm(arch, seed=2)
    ids = _ids(2, 40, 6)
    with torch.no_grad():
        full = model(ids)
        half = model.to(torch.bfloat16)(ids)
    assert half.dtype == torch.bfloat16
    assert model.blocks[0].mixer.last_path["scan"] == "torch.ssd"
    err = (half.float() - full).abs().max().item()
    assert err < 0.15 * full.abs().max().item(), err
    assert (half.float().argmax(-1) == full.argmax(-1)).float().mean().item() > 0.9
