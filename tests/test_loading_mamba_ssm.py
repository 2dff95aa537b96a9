"""load_model on checkpoints in state-spaces' original mamba_ssm format, converted on the fly.

Each checkpoint here is a tiny Hugging Face Mamba / Mamba-2 model written back in mamba_ssm's
layout (its config.json keys and MambaLMHeadModel state-dict names, vocab padded to
``pad_vocab_size_multiple``), so the converted model must reproduce the Hugging Face logits.
"""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from gna_lens import load_model
from gna_lens.errors import ConfigError
from gna_lens.models import HookedSSM, provenance_of
from gna_lens.testing import tiny_hf_model, tiny_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def mamba_ssm_config(hf_config, *, vocab_size: int = 317, multiple: int = 8) -> dict:
    """The mamba_ssm config.json of a transformers Mamba / Mamba-2 config (317 -> 320 rows)."""
    assert math.ceil(vocab_size / multiple) * multiple == hf_config.vocab_size
    top = {
        "d_model": hf_config.hidden_size,
        "d_intermediate": 0,
        "n_layer": hf_config.num_hidden_layers,
        "vocab_size": vocab_size,
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": hf_config.residual_in_fp32,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": multiple,
        "tie_embeddings": hf_config.tie_word_embeddings,
    }
    if hf_config.model_type == "mamba":
        ssm = {
            "d_state": hf_config.state_size,
            "d_conv": hf_config.conv_kernel,
            "expand": hf_config.expand,
            "dt_rank": hf_config.time_step_rank,
        }
    else:
        ssm = {
            "layer": "Mamba2",
            "d_state": hf_config.state_size,
            "d_conv": hf_config.conv_kernel,
            "expand": hf_config.expand,
            "headdim": hf_config.head_dim,
            "ngroups": hf_config.n_groups,
            "chunk_size": hf_config.chunk_size,
            "dt_limit": list(hf_config.time_step_limit),
            "rmsnorm": True,
            "norm_before_gate": False,
        }
    return top | {"ssm_cfg": ssm}


def mamba_ssm_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """transformers names -> MambaLMHeadModel names (only the embedding differs)."""
    out = {}
    for key, value in hf_model.state_dict().items():
        out[key.replace("backbone.embeddings.", "backbone.embedding.")] = value.clone()
    return out


def write_mamba_ssm(hf_model, folder: Path, fmt: str = "bin", **config_overrides) -> Path:
    """A mamba_ssm checkpoint folder: config.json, weights (``bin`` / ``safetensors``), tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    config = mamba_ssm_config(hf_model.config) | config_overrides
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    state = mamba_ssm_state_dict(hf_model)
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")  # tied head saved too, as mamba_ssm does
    else:
        from safetensors.torch import save_file

        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_file(state, str(folder / "model.safetensors"))
    tiny_tokenizer().save_pretrained(folder)
    return folder


CASES = [
    ("mamba1", {}),
    ("mamba1", {"tie_word_embeddings": False}),
    ("mamba2", {"n_groups": 2, "chunk_size": 8}),
    ("mamba2", {"n_groups": 1, "tie_word_embeddings": True, "time_step_limit": (0.05, 0.6)}),
]


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_converted_logits_match_hf(case, fmt, tmp_path):
    arch, overrides = case
    hf = tiny_hf_model(arch, seed=5, **overrides)
    folder = write_mamba_ssm(hf, tmp_path / "ckpt", fmt)
    model = load_model(folder)
    assert isinstance(model, HookedSSM)
    tokens = torch.randint(2, 317, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        out = model(tokens)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=0), (out - ref).abs().max()
    # the folder's tokenizer came along: strings work
    assert model("a b c").shape[-1] == 320
    prov = provenance_of(model)
    weights = "pytorch_model.bin" if fmt == "bin" else "model.safetensors"
    digest = hashlib.sha256((folder / weights).read_bytes()).hexdigest()
    assert (prov.source, prov.format, prov.files) == ("local", "mamba_ssm", ((weights, digest),))
    assert "converted on the fly" in prov.describe()
    assert prov.stored_dtype == "float32" and prov.dtype == "float32"


def test_safetensors_preferred_over_bin(tmp_path):
    """With both files present the safetensors one is read (the .bin holds other weights)."""
    chosen, other = tiny_hf_model("mamba2", seed=1), tiny_hf_model("mamba2", seed=2)
    folder = write_mamba_ssm(chosen, tmp_path / "ckpt", "safetensors")
    torch.save(mamba_ssm_state_dict(other), folder / "pytorch_model.bin")
    tokens = torch.randint(2, 317, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = load_model(folder)(tokens)
        assert torch.allclose(out, chosen(tokens).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(out, other(tokens).logits, atol=1e-2)
    assert provenance_of(load_model(folder)).files[0][0] == "model.safetensors"


def test_bin_in_torch_legacy_format_loads(tmp_path):
    """Old checkpoints saved without the zip format cannot be memory-mapped; they still load."""
    hf = tiny_hf_model("mamba1", seed=3)
    folder = write_mamba_ssm(hf, tmp_path / "ckpt", "bin")
    state = mamba_ssm_state_dict(hf)
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    tokens = torch.randint(2, 317, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(load_model(folder)(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


class _Payload:
    """A pickle that runs code when loaded without ``weights_only``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pickle code ran"))


def test_bin_is_read_with_weights_only(tmp_path):
    hf = tiny_hf_model("mamba1", seed=0)
    folder = write_mamba_ssm(hf, tmp_path / "ckpt", "bin")
    marker = tmp_path / "ran.txt"
    torch.save({"backbone.embedding.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"cannot read .*pytorch_model\.bin"):
        load_model(folder)
    assert not marker.exists()


def test_missing_weights_file_names_the_expected_files(tmp_path):
    folder = write_mamba_ssm(tiny_hf_model("mamba2"), tmp_path / "ckpt", "bin")
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"model\.safetensors or pytorch_model\.bin"):
        load_model(folder)


BAD_CONFIGS = [
    # (arch, change to config.json, text the error must contain)
    ("mamba2", {"d_model": None}, "'d_model' is missing"),
    ("mamba2", {"n_layer": "2"}, "n_layer='2' must be a positive int"),
    ("mamba2", {"rms_norm": False}, "rms_norm=False"),
    ("mamba2", {"d_intermediate": 64}, "d_intermediate=64"),
    ("mamba2", {"attn_layer_idx": [1]}, "attn_layer_idx=[1]"),
    ("mamba2", {"n_layer_typo": 2}, "n_layer_typo is not a known mamba_ssm option"),
    ("mamba2", {"ssm_cfg": {"layer": "Mamba3"}}, "ssm_cfg.layer='Mamba3'"),
    ("mamba2", {"ssm_cfg.norm_before_gate": True}, "ssm_cfg.norm_before_gate=True"),
    ("mamba2", {"ssm_cfg.D_has_hdim": True}, "ssm_cfg.D_has_hdim=True"),
    ("mamba2", {"ssm_cfg.headdim": 7}, "ssm_cfg.headdim=7 does not divide"),
    ("mamba2", {"ssm_cfg.ngroups": 3}, "ssm_cfg.ngroups=3"),
    ("mamba2", {"ssm_cfg.d_ssm": 32}, "ssm_cfg.d_ssm=32"),
    ("mamba1", {"ssm_cfg.dt_rnak": 4}, "ssm_cfg.dt_rnak is not a known"),
    ("mamba1", {"pad_vocab_size_multiple": 128}, "give 384 embedding rows"),
    ("mamba2", {"n_layer": 3}, "missing ['backbone.layers.2."),
    ("mamba2", {"ssm_cfg.d_state": 16}, "do not fit the shapes"),
    ("mamba1", {"tie_embeddings": False}, "missing ['lm_head.weight']"),
]


@pytest.mark.parametrize("arch,change,message", BAD_CONFIGS, ids=[m for *_, m in BAD_CONFIGS])
def test_bad_config_names_the_key(arch, change, message, tmp_path):
    hf = tiny_hf_model(arch, seed=0, tie_word_embeddings=True)
    config = mamba_ssm_config(hf.config)
    for key, value in change.items():
        if key.startswith("ssm_cfg."):
            config["ssm_cfg"][key.removeprefix("ssm_cfg.")] = value
        elif value is None:
            del config[key]
        else:
            config[key] = value
    folder = write_mamba_ssm(hf, tmp_path / "ckpt", "safetensors")
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_model(folder)
    assert message in str(err.value)


def test_tied_head_that_differs_from_embedding_raises(tmp_path):
    hf = tiny_hf_model("mamba2", seed=0, tie_word_embeddings=False)
    folder = write_mamba_ssm(hf, tmp_path / "ckpt", "bin", tie_embeddings=True)
    with pytest.raises(ConfigError, match=r"tie_embeddings is true but lm_head\.weight differs"):
        load_model(folder)


def test_hub_repository_is_downloaded_and_converted(tmp_path, monkeypatch):
    """A hub name in mamba_ssm format (``state-spaces/mamba2-130m`` style): the files come
    from the hub cache's snapshot folder and the provenance records its commit."""
    import huggingface_hub

    from gna_lens.models import gguf

    hf = tiny_hf_model("mamba2", seed=4)
    snapshot = write_mamba_ssm(hf, tmp_path / "snapshots" / COMMIT, "bin")
    asked = []

    def fake_download(repo_id, filename, revision=None, local_files_only=False, **_):
        asked.append((repo_id, filename))
        path = snapshot / filename
        if not path.is_file():
            raise huggingface_hub.errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(gguf, "hub_reachable", lambda timeout=1.5: True)
    model = load_model("state-spaces/tiny-mamba2")
    assert ("state-spaces/tiny-mamba2", "config.json") in asked
    tokens = torch.randint(2, 317, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    prov = provenance_of(model)
    assert (prov.source, prov.format, prov.revision) == ("hub", "mamba_ssm", COMMIT)
    assert prov.location == "state-spaces/tiny-mamba2"
    assert model.cfg.model_name == "state-spaces/tiny-mamba2"
