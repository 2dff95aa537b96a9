"""Offline stand-ins for the hub models the tutorials' Colab branches load (issue 40).

No hub is reachable in CI, so each hub name maps to a checkpoint written here and loaded through
the same :func:`gna_lens.load_model` path a downloaded folder takes:

- ``HuggingFaceTB/SmolLM2-135M``: the packaged SmolLM2-135M-Instruct GGUF (the same config and
  tokenizer; instruct weights, Q4_1 dequantized).
- ``meta-llama/Llama-3.2-1B``: random weights with its head layout (16 layers of 32 query and 8
  KV heads: 512 heads, above the exact-ablation limit, so the coarse-to-fine path runs) at width
  512 instead of 2048; SmolLM2's tokenizer (Llama-3's is gated).
- ``state-spaces/mamba2-130m``: random weights with its config (24 layers, d_model 768, 24 heads
  of 64, d_state 128), in transformers' format (the hub repo is mamba_ssm's); SmolLM2's tokenizer
  (GPT-NeoX's does not ship offline).
- ``state-spaces/mamba-130m-hf``: random weights with its config (24 layers, d_model 768, d_inner
  1536, d_state 16); SmolLM2's tokenizer.

Random weights do not retrieve: cells that act only on a model above chance take their "not
ranked" branch for the random stand-ins (the test says which).
"""

import os
from pathlib import Path
from typing import Any

#: hub name -> (architecture, config overrides); None: the packaged SmolLM2 GGUF.
STANDINS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "HuggingFaceTB/SmolLM2-135M": None,
    "meta-llama/Llama-3.2-1B": (
        "llama",
        dict(
            hidden_size=512,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=16,
            intermediate_size=1024,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    "state-spaces/mamba2-130m": (
        "mamba2",
        dict(
            hidden_size=768,
            num_hidden_layers=24,
            num_heads=24,
            head_dim=64,
            state_size=128,
            n_groups=1,
            expand=2,
            conv_kernel=4,
            chunk_size=256,
        ),
    ),
    "state-spaces/mamba-130m-hf": (
        "mamba1",
        dict(
            hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, intermediate_size=1536
        ),
    ),
}


def _smollm2_folder() -> Path:
    from gna_lens.models import gguf

    return Path(gguf.convert_gguf(gguf.packaged_gguf_path("smollm2-135m")))


def standin_folder(name: str, root: Path) -> Path:
    """The checkpoint folder standing in for hub model ``name`` (written under ``root`` once)."""
    if STANDINS[name] is None:
        return _smollm2_folder()
    from transformers import AutoTokenizer

    from gna_lens.testing import tiny_hf_model

    arch, overrides = STANDINS[name]  # type: ignore[misc]
    folder = root / name.replace("/", "--")
    if not (folder / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(_smollm2_folder())
        tiny_hf_model(arch, vocab_size=len(tok), **overrides).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def install(root: str | os.PathLike[str]) -> None:
    """Make ``gna_lens.load_model`` (and ``gna_lens.models.load_model``) load the stand-ins for
    the hub names above; every other name loads as usual. Called by the notebook's first cell."""
    import gna_lens
    import gna_lens.models

    real = gna_lens.models.load_model

    def load_model(name_or_path: Any, **kwargs: Any) -> Any:
        if str(name_or_path) in STANDINS:
            name_or_path = standin_folder(str(name_or_path), Path(root))
        return real(name_or_path, **kwargs)

    gna_lens.load_model = load_model
    gna_lens.models.load_model = load_model
