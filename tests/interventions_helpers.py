"""Tiny models and tasks shared by the tests of gna_lens.heads and gna_lens.interventions."""

import functools
import random
import tempfile
from pathlib import Path

import torch

from gna_lens.tasks import KV_TEMPLATES, Task, build_sample, kv_retrieval
from gna_lens.tasks._testing import word_tokenizer

KEYS = ("apple", "river", "stone", "cloud", "lamp", "tree", "house", "bird")
SSM_ARCHS = ("mamba1", "falcon_mamba", "mamba2", "bamba")
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
