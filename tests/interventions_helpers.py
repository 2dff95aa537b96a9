"""Tiny models and tasks shared by the tests of gna_lens.heads and gna_lens.interventions."""

import functools
import random
import tempfile
from pathlib import Path

import torch

from gna_lens.tasks import KV_TEMPLATES, Task, build_sample, kv_retrieval
from gna_lens.tasks.toy_tokenizers import word_tokenizer

KEYS = ("apple", "river", "stone", "cloud", "lamp", "tree", "house", "bird")
SSM_ARCHS = (
    "mamba1",
    "falcon_mamba",
    "mamba2",
    "bamba",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "jamba",
    "zamba2",
    "llamba",
)
_TMP = Path(tempfile.mkdtemp(prefix="gna_lens_interventions_"))


@functools.cache
def tok():
    """A word-level tokenizer: every key, value (0-99) and template word is one token."""
    return word_tokenizer(
        ["Memorize the following dictionary:", "The value of the key '", " is", *KEYS]
    )


@functools.cache
def task(n_pairs: int = 4, n_samples: int = 4, seed: int = 0, scoring: str = "choices") -> Task:
    return kv_retrieval(
        tok(), n_pairs=n_pairs, n_samples=n_samples, words=KEYS, seed=seed, scoring=scoring
    )


def other_key(t: Task, seed: int = 0) -> Task:
    """The same dictionaries queried for another key (a corrupted run of the same length)."""
    rng = random.Random(seed)
    template = KV_TEMPLATES["paper"]
    out = []
    for s in t:
        keys, values = s.info["keys"], s.info["values"]
        key = rng.choice([k for k in keys if k != s.info["query_key"]])
        prompt, lines, _, _ = template.render_prompt(list(zip(keys, values, strict=True)), key)
        out.append(
            build_sample(tok(), prompt, lines, answer_segment=keys.index(key), choices=s.choices)
        )
    return Task(tuple(out), name=f"{t.name} other key", pad_token_id=t.pad_token_id)


@functools.cache
def model(arch: str):
    """A tiny model over tok()'s vocabulary: a HookedSSM, or a TransformerBridge over Llama/OPT."""
    if arch in SSM_ARCHS:
        from gna_lens.testing import tiny_hooked_ssm

        return tiny_hooked_ssm(arch, vocab_size=len(tok()))
    from transformer_lens.model_bridge import TransformerBridge

    path = _TMP / arch
    if arch == "llama":
        from gna_lens.testing import tiny_checkpoint

        tiny_checkpoint("llama", path, vocab_size=len(tok()))
    elif arch == "opt":  # an attention bridge that discards pattern edits
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.OPTConfig(
            vocab_size=len(tok()),
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=32,
            pad_token_id=3,
            bos_token_id=1,
            eos_token_id=2,
        )
        tf.OPTForCausalLM(cfg).eval().save_pretrained(path)
    else:
        raise ValueError(arch)
    tok().save_pretrained(path)
    return TransformerBridge.boot_transformers(str(path))


def hook_count(m) -> int:
    seen, total = set(), 0
    for hp in m.hook_dict.values():
        if id(hp) in seen:
            continue
        seen.add(id(hp))
        total += len(hp.fwd_hooks) + len(hp.bwd_hooks) + len(hp._forward_hooks)
        total += len(hp._backward_hooks) + len(hp._forward_pre_hooks)
    return total


def weights(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def tokens(t: Task) -> torch.Tensor:
    """Unpadded token ids of a task whose prompts all have the same length."""
    return torch.tensor([s.input_ids for s in t])


# ----------------------------------------------------------------------------- prompts with BOS
@functools.cache
def bos_tok():
    """A word tokenizer that prepends BOS (``<s>``) to every prompt."""
    return word_tokenizer(
        ["Memorize the following dictionary:", "The value of the key '", " is", *KEYS], bos=True
    )


@functools.cache
def bos_task(n_pairs: int, n_samples: int, seed: int) -> Task:
    """KV retrieval whose every prompt starts with BOS."""
    return kv_retrieval(bos_tok(), n_pairs=n_pairs, n_samples=n_samples, words=KEYS, seed=seed)


@functools.cache
def bos_model(arch: str):
    """A tiny HookedSSM (``arch``) or Llama TransformerBridge whose tokenizer is bos_tok()."""
    if arch != "llama":
        from gna_lens.models import HookedSSM
        from gna_lens.testing import tiny_hf_model

        return HookedSSM.from_hf_model(tiny_hf_model(arch, vocab_size=len(bos_tok())), bos_tok())
    from transformer_lens.model_bridge import TransformerBridge

    from gna_lens.testing import tiny_checkpoint

    path = Path(tempfile.mkdtemp(prefix="gna_lens_bos_")) / "llama"
    tiny_checkpoint("llama", path, vocab_size=len(bos_tok()))
    bos_tok().save_pretrained(path)
    return TransformerBridge.boot_transformers(str(path))


def hand_picks(n: int, positions, include_bos: bool = False) -> list[int]:
    """The positions of an ``n``-token prompt starting with BOS that a mean ablation averages
    over and edits, as a careful researcher picks them: the last token for ``"last"``, the listed
    positions (each once) for a list, every position for ``None``; position 0 (the BOS) left out
    unless ``include_bos``."""
    if positions == "last":
        picked = [n - 1]
    elif positions is None:
        picked = list(range(n))
    else:
        picked = sorted({p % n for p in positions})
    return picked if include_bos else [p for p in picked if p != 0]


def hand_class_mean(reference: Task, value, positions, include_bos: bool = False) -> torch.Tensor:
    """The mean over the reference prompts of ``value(ids [1, pos]) -> [pos, ...]`` at
    :func:`hand_picks`, each prompt run alone (each (prompt, position) counts once)."""
    rows = []
    for s in reference:
        assert s.input_ids[0] == bos_tok().bos_token_id
        x = value(torch.tensor([s.input_ids]))[0]
        rows.append(x[hand_picks(x.shape[0], positions, include_bos)])
    return torch.cat(rows).mean(0)


def hand_columns(P: int, positions, include_bos: bool = False) -> torch.Tensor:
    """``[P]`` bool: the columns a mean ablation edits in inputs of ``P`` tokens starting
    with BOS."""
    cols = torch.zeros(P, dtype=torch.bool)
    cols[hand_picks(P, positions, include_bos)] = True
    return cols
