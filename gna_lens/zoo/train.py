"""Train the zoo: small HF-format models on the synthetic curriculum, with measured cards.

``gna-lens train-zoo`` (or ``python -m gna_lens.zoo.train``) trains every zoo model from a fixed
seed with plain Hugging Face models (torch forward, CPU is fine), saves each as a checkpoint
folder (``model.safetensors``, ``config.json``, tokenizer), then re-loads it the way users do
(:func:`gna_lens.zoo.load`) and measures the card's accuracies on the held-out splits of
:func:`gna_lens.zoo.tasks`. Never run in CI: each model takes 10-30 minutes on one CPU thread.
It writes under ``--out`` (default ``./zoo_models``); the shipped checkpoints are replaced only
when ``--out`` names their folder (``gna_lens.zoo.MODELS_DIR``).

Examples:
    Retrain one model into a scratch folder (slow, so not run here)::

        $ gna-lens train-zoo zoo-llama --out /tmp/zoo --steps 3000
"""

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from gna_lens.device import HOST, DevicePolicy
from gna_lens.errors import ConfigError
from gna_lens.heads import HookedModel
from gna_lens.zoo.curriculum import (
    EVAL_SEED,
    EVAL_TASKS,
    KV_EVAL_SAMPLES,
    KV_MAX_PAIRS,
    KV_QUERIES,
    MC_EVAL_DRAWS,
    World,
    build_tokenizer,
    eval_tasks,
    load_world,
    training_batches,
)

__all__ = [
    "RECIPES",
    "Recipe",
    "build_model",
    "fan_in_init",
    "init_like_mamba2",
    "measure",
    "train_model",
    "train_zoo_main",
    "zero_residual_outputs",
]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one zoo model is built and trained.

    Attributes:
        name: The zoo name (``"zoo-llama"``).
        config_class: The ``transformers`` config class name.
        config: Its fields (``vocab_size`` and special token ids are added from the tokenizer).
        steps: Optimizer steps.
        batch_size: Documents per step (each batch is all KV or all facts, alternating).
        lr: Peak learning rate (linear warm-up, cosine decay to 10%; 1e-3 beat 3e-3 and 1e-2
            for the Transformer, which stalled at the higher rates).
        warmup: Warm-up steps.
        seed: Seed of the weights and of the training documents.
        description: One line for the card.
        aux_prev_tokens: Offsets ``k`` of an auxiliary training loss that predicts, from the
            residual stream after layer ``aux_layer``, the token ``k`` positions back (a
            training-only linear probe, discarded with its loss; the saved model is a plain HF
            model). It hands a small Transformer the previous-token half of an induction circuit,
            the half whose slow formation otherwise stalls retrieval for thousands of steps.
            Not used by the shipped recipes: on zoo-llama, ``(1, 2)`` had not made KV retrieval
            leave chance after 1,250 of 3,000 steps, no better than without it.
        aux_layer: The hidden-state index the auxiliary probes read (1: after the first layer).
        aux_weight: Weight of the auxiliary loss.
        kv_fraction: Fraction of the batches that are KV retrieval (the rest are facts).
        mamba2_init: Re-initialize a hybrid's Mamba-2 mixers as ``transformers`` initializes a
            Mamba-2 model (see :func:`init_like_mamba2`) instead of Bamba's attention-style init.
        zero_init_residual: Start every attention output projection (``o_proj``) and MLP down
            projection (``down_proj``) at zero (see :func:`zero_residual_outputs`), so that
            attention and MLP blocks join the residual stream only as training grows them.
        embedding_std: Re-draw the token embeddings from ``N(0, embedding_std)`` (``None``:
            keep the architecture's init; Mamba-2 uses 0.1, Llama and Bamba 0.02).
        fan_in_init: Re-draw every linear layer but the (tied) output head with torch's default
            ``nn.Linear`` init, uniform with bound ``1 / sqrt(fan_in)`` (see :func:`fan_in_init`),
            instead of the architecture's ``N(0, 0.02)``.
    """

    name: str
    config_class: str
    config: dict[str, Any]
    steps: int
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 200
    seed: int = 0
    description: str = ""
    aux_prev_tokens: tuple[int, ...] = ()
    aux_layer: int = 1
    aux_weight: float = 0.3
    kv_fraction: float = 0.5
    mamba2_init: bool = False
    zero_init_residual: bool = False
    embedding_std: float | None = None
    fan_in_init: bool = False


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe(
            name="zoo-llama",
            config_class="LlamaConfig",
            config=dict(
                hidden_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=4,
                intermediate_size=384,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            ),
            steps=4000,
            fan_in_init=True,
            embedding_std=0.3,
            description="Llama-architecture Transformer: 4 layers x 4 attention heads",
        ),
        Recipe(
            name="zoo-mamba2",
            config_class="Mamba2Config",
            config=dict(
                hidden_size=128,
                num_hidden_layers=4,
                state_size=32,
                expand=2,
                num_heads=8,
                head_dim=32,
                n_groups=1,
                conv_kernel=4,
                chunk_size=64,
                tie_word_embeddings=True,
            ),
            steps=1500,
            description="Mamba-2: 4 layers x 8 SSM heads (head_dim 32, d_state 32)",
        ),
        Recipe(
            name="zoo-mamba1",
            config_class="MambaConfig",
            config=dict(
                hidden_size=128,
                num_hidden_layers=4,
                state_size=8,
                expand=2,
                conv_kernel=4,
                use_conv_bias=True,
                tie_word_embeddings=True,
            ),
            steps=1200,
            description="Mamba-1: 4 layers, 256 channels (d_state 8)",
        ),
        Recipe(
            name="zoo-bamba",
            config_class="BambaConfig",
            config=dict(
                hidden_size=128,
                num_hidden_layers=5,
                intermediate_size=256,
                num_attention_heads=4,
                num_key_value_heads=4,
                attn_layer_indices=[3],
                mamba_n_heads=8,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=32,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=64,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            ),
            steps=2000,
            kv_fraction=0.75,
            mamba2_init=True,
            zero_init_residual=True,
            embedding_std=0.1,
            description="Bamba hybrid: 4 Mamba-2 layers + 1 attention layer (layer 3), with MLPs",
        ),
    ]
}


def _selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **_: Any,
) -> Any:
    """HF Mamba-1's reference selective scan, re-laid out time-major for a fast CPU backward.

    Same maths and signature as ``transformers``' ``mamba_selective_scan`` fallback, whose
    backward through ``states[:, :, t]`` indexing costs O(length^2) memory traffic (50 s per
    step here); slicing a time-major tensor with ``unbind`` keeps it linear.
    """
    import torch.nn.functional as F

    dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    u = hidden_states.float()
    dt_t = dt.float().permute(2, 0, 1)  # [pos, batch, channel]
    decay = torch.exp(dt_t[..., None] * A.float())  # [pos, batch, channel, state]
    write = (dt_t * u.permute(2, 0, 1))[..., None] * B.float().permute(2, 0, 1)[:, :, None, :]
    h = torch.zeros_like(decay[0])
    states = []
    for a_t, w_t in zip(decay.unbind(0), write.unbind(0), strict=True):
        h = torch.addcmul(w_t, a_t, h)
        states.append(h)
    y = torch.einsum("lbdn,bnl->bdl", torch.stack(states, 0), C.float())
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    y = y.to(dtype)
    return (y, h) if return_last_state else y


def tie_space_variants(model: HookedModel, tokenizer: Any) -> int:
    """Initialize each ``" word"`` token's embedding to that of ``"word"``; returns how many.

    The paper's template shows a value as ``"50"`` in the dictionary but scores it as ``" 50"``;
    starting both tokens at the same embedding makes copying a value (or an option's text) an
    identity map at initialization instead of a mapping to learn. They are free to diverge.
    """
    emb = model.get_input_embeddings().weight
    vocab = tokenizer.get_vocab()
    n = 0
    with torch.no_grad():
        for token, i in vocab.items():
            if token.startswith(" ") and token[1:] in vocab:
                emb[i] = emb[vocab[token[1:]]]
                n += 1
    return n


def build_model(recipe: Recipe, tokenizer: Any) -> Any:
    """A freshly initialized HF causal LM for ``recipe`` (seeded).

    Raises:
        ConfigError: If ``recipe.config_class`` is not a ``transformers`` config class.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    cls = getattr(transformers, recipe.config_class, None)
    if cls is None:
        raise ConfigError(
            f"recipe {recipe.name!r}: config_class={recipe.config_class!r} is not in transformers "
            f"{transformers.__version__}; expected e.g. 'LlamaConfig'."
        )
    config = cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **recipe.config,
    )
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config)
    if recipe.fan_in_init:
        fan_in_init(model)
    if recipe.mamba2_init:
        init_like_mamba2(model)
    if recipe.zero_init_residual:
        zero_residual_outputs(model)
    if recipe.embedding_std is not None:
        with torch.no_grad():
            torch.nn.init.normal_(model.get_input_embeddings().weight, std=recipe.embedding_std)
    return model


def fan_in_init(model: HookedModel) -> int:
    """Re-draw every linear layer with torch's default init; returns how many.

    ``nn.Linear.reset_parameters``: weights Kaiming-uniform with bound ``1 / sqrt(fan_in)``
    (0.051 standard deviation for 128 inputs, where Llama's init is ``N(0, 0.02)``), biases
    uniform with the same bound. The output head is skipped when its weight is the input
    embedding (tied). Together with larger embeddings (``Recipe.embedding_std``) this took a
    2-layer Llama out of the chance plateau on bare key-value recall (4 pairs) within 1,000
    steps, where its own init was still at chance after 3,000 (see the gotcha "A small
    Transformer trained from scratch ..."). Uses torch's global generator.

    Raises:
        ConfigError: If ``model`` has no linear layer besides a tied output head.
    """
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    tied = None if embeddings is None else embeddings.weight
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not tied:
            module.reset_parameters()
            n += 1
    if n == 0:
        raise ConfigError(
            f"fan_in_init: {type(model).__name__} has no torch.nn.Linear layer to re-initialize "
            "(besides a tied output head); expected a transformers causal LM."
        )
    return n


def zero_residual_outputs(model: HookedModel) -> int:
    """Zero every attention output projection and MLP down projection; returns how many.

    Matches parameters named ``*.o_proj.weight`` (attention) and ``*.down_proj.weight`` (gated
    MLPs), as in Llama, Mistral, Qwen2 and Bamba; SSM mixers' ``out_proj`` is left alone. Each
    such block then adds nothing to the residual stream at initialization. In zoo-bamba's
    diagnostics, Bamba's ``N(0, 0.02)`` attention and MLP outputs kept its Mamba-2 layers from
    learning KV retrieval (see the gotcha "A small Transformer trained from scratch ...").

    Raises:
        ConfigError: If ``model`` has no such projection.
    """
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
                n += 1
    if n == 0:
        raise ConfigError(
            f"zero_residual_outputs: {type(model).__name__} has no parameter named *.o_proj.weight "
            "or *.down_proj.weight; expected a Llama-style attention or gated-MLP block."
        )
    return n


def init_like_mamba2(
    model: HookedModel, std: float = 0.1, dt_min: float = 1e-3, dt_max: float = 0.1
) -> int:
    """Initialize every Mamba-2 mixer of a hybrid the way ``transformers`` initializes Mamba-2.

    ``transformers`` initializes Bamba's mixers like its attention layers: every weight
    ``N(0, 0.02)`` (so the SSM's ``B``, ``C`` and ``x``, which pass through a 4-tap convolution
    with 0.02 weights, start near zero) and ``dt_bias = 1`` (so every head starts with
    ``dt = softplus(1) = 1.3`` and forgets its state within a token or two). Trained from there,
    the hybrid sat at chance on KV retrieval for 800 steps where zoo-mamba2 had learned it by 500.
    This applies ``Mamba2PreTrainedModel``'s scheme instead: ``in_proj ~ N(0, std)`` (its
    ``initializer_range``), Kaiming-uniform ``conv1d`` and ``out_proj``, zero conv bias, and ``dt``
    drawn log-uniformly in ``[dt_min, dt_max]`` (stored as its inverse softplus). Attention and MLP
    layers keep Bamba's init. Uses torch's global generator.

    Returns:
        How many mixers it re-initialized.

    Raises:
        ConfigError: If ``model`` has no Mamba-2 mixer.
    """
    n = 0
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "dt_bias") or not hasattr(module, "conv1d"):
                continue
            torch.nn.init.normal_(module.in_proj.weight, std=std)
            torch.nn.init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))
            if module.conv1d.bias is not None:
                torch.nn.init.zeros_(module.conv1d.bias)
            torch.nn.init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
            # Drawn on the host from torch's global CPU generator (the recipe's seed), then
            # copied into the parameter wherever it lives.
            u = torch.rand(module.dt_bias.shape, device=HOST)
            dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            n += 1
    if n == 0:
        raise ConfigError(
            f"init_like_mamba2: {type(model).__name__} has no Mamba-2 mixer (a module with "
            "dt_bias and conv1d); expected a Bamba or other Mamba-2 hybrid."
        )
    return n


def _lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _quick_eval(model: HookedModel, tasks: dict[str, Any], n: int = 60) -> dict[str, float]:
    from gna_lens.tasks import evaluate

    model.eval()
    out = {
        k: round(evaluate(model, t[:n], batch_size=32, progress=False).accuracy, 3)
        for k, t in tasks.items()
    }
    model.train()
    return out


def _aux_loss(
    model: HookedModel,
    probes: dict[int, Any],
    hidden: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """Mean cross-entropy of the probes predicting the token ``k`` back (see :class:`Recipe`)."""
    emb = model.get_input_embeddings().weight
    total = torch.zeros((), device=emb.device)
    for k, probe in probes.items():
        h = hidden[layer][:, k:]
        target = ids[:, :-k].masked_fill(mask[:, k:] == 0, -100)
        logits = probe(h) @ emb.T
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        )
    return total / len(probes)


def train_model(
    recipe: Recipe,
    out_dir: str | Path,
    *,
    world: World | None = None,
    steps: int | None = None,
    eval_every: int = 500,
    progress: bool = True,
) -> dict[str, Any]:
    """Train one zoo model and save it (weights, config, tokenizer) to ``out_dir``.

    Args:
        recipe: What to build and how long to train.
        out_dir: The checkpoint folder to write.
        world: The curriculum's world; defaults to the shipped one.
        steps: Override ``recipe.steps``.
        eval_every: Print a quick held-out accuracy every this many steps (0: never).
        progress: Show a progress bar.

    Returns:
        Training facts for the card: steps, time, final loss, parameters, ...
    """
    from tqdm import tqdm

    if steps is not None:
        recipe = dataclasses.replace(recipe, steps=steps)
    world = world or load_world()
    tokenizer = build_tokenizer(world)
    random.seed(recipe.seed)
    model = build_model(recipe, tokenizer)
    tie_space_variants(model, tokenizer)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    width = model.config.hidden_size
    policy = DevicePolicy.of(model)
    device = policy.device
    aux: dict[int, Any] = {
        k: torch.nn.Linear(width, width, bias=False, device=device) for k in recipe.aux_prev_tokens
    }
    decay += [p for probe in aux.values() for p in probe.parameters()]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.98),
    )
    data = training_batches(
        world, tokenizer, recipe.batch_size, seed=recipe.seed, kv_fraction=recipe.kv_fraction
    )
    quick = {
        k: v
        for k, v in eval_tasks(tokenizer, world).items()
        if k in ("kv-4", "kv-8", "letter", "cloze")
    }
    print(f"{recipe.name}: {n_params:,} parameters, {recipe.steps} steps", flush=True)
    t0 = time.perf_counter()
    losses: list[float] = []
    ema: float | None = None
    bar = tqdm(range(recipe.steps), desc=recipe.name, disable=not progress, mininterval=10)
    fast_scan: Any = contextlib.nullcontext()
    if model.config.model_type in ("mamba", "falcon_mamba"):  # HF Mamba-1: _selective_scan
        import transformers.models.mamba.modeling_mamba as mm

        fast_scan = mock.patch.object(mm, "mamba_selective_scan", _selective_scan)
    with fast_scan:
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, recipe)
            ids, mask, labels = (policy.put(t) for t in next(data))
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=bool(aux))
            logits = out.logits
            lm_loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
            loss = lm_loss
            if aux:
                loss = loss + recipe.aux_weight * _aux_loss(
                    model, aux, out.hidden_states, ids, mask, recipe.aux_layer
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            value = float(lm_loss.detach())
            losses.append(value)
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == recipe.steps):
                acc = _quick_eval(model, quick)
                print(
                    f"{recipe.name} step {step + 1}: loss {ema:.3f}, held-out {acc}, "
                    f"{time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
    bar.close()
    seconds = time.perf_counter() - t0
    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    facts = dataclasses.asdict(recipe)
    for key in ("name", "config_class", "config", "description"):
        del facts[key]
    return {
        **facts,  # the recipe's training fields, in their order
        "aux_prev_tokens": list(recipe.aux_prev_tokens),
        "train_seconds": round(seconds, 1),
        "final_loss": round(sum(losses[-100:]) / max(1, len(losses[-100:])), 4),
        "n_params": n_params,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "machine": platform.machine(),
    }


def measure(path: str | Path, *, progress: bool = False) -> dict[str, dict[str, float]]:
    """Accuracies of the checkpoint at ``path`` on the held-out splits, loaded as users load it.

    Returns:
        ``{task: {"accuracy": ..., "chance": ..., "n": ...}}`` for every task of
        :data:`~gna_lens.zoo.curriculum.EVAL_TASKS`.
    """
    from gna_lens.models import load_model
    from gna_lens.tasks import evaluate

    model = load_model(str(path))
    tasks = eval_tasks(model.tokenizer)
    out = {}
    for name in EVAL_TASKS:
        res = evaluate(model, tasks[name], batch_size=50, progress=progress)
        out[name] = {"accuracy": round(res.accuracy, 4), "chance": res.chance, "n": len(res)}
    return out


def _model_facts(path: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    d = cfg.to_diff_dict()
    keep = [k for k in d if not k.startswith("_") and k not in ("transformers_version", "dtype")]
    return {
        "architecture": (cfg.architectures or ["?"])[0],
        "model_type": cfg.model_type,
        "config": {k: d[k] for k in sorted(keep)},
    }


_README = """# {name}

{description}. Trained by gna_lens on its synthetic curriculum (`gna_lens.zoo.curriculum`), shipped
inside the package so that every example runs offline. Load it with
`gna_lens.zoo.load("{name}")` ({loader}) or with plain transformers from `gna_lens.zoo.path("{name}")`.

| | |
|---|---|
| architecture | `{architecture}` (`model_type: {model_type}`) |
| parameters | {n_params:,} |
| training | {steps} steps x {batch_size} documents ({kv_pct:.0f}% of the batches KV retrieval), AdamW lr {lr}, seed {seed}, {minutes:.1f} min on {threads} CPU thread(s){init} |
| final training loss | {final_loss} (answer tokens only) |
| tokenizer | word-level, {vocab} tokens (every key, value, entity, attribute and letter is one token) |

## Measured accuracy (held-out splits of `gna_lens.zoo.tasks()`)

Measured with `gna_lens.tasks.evaluate` on the model loaded by `gna_lens.zoo.load`; every task is
scored over its choices (log-likelihood). KV retrieval: {kv_n} prompts per size in the paper's
template (seed {seed_eval} + n_pairs), chance 1/n_pairs. `letter` / `cloze`: the same {mc_n}
prompts (every fact once, with fresh distractors and order), scored on the letter (MMLU format:
the fact from the weights, the letter looked up in context) or on the option's text (the fact
alone). `letter-unseen`: {unseen_n} letter-format prompts ({draws} draws) about the 60 facts never
trained in letter format.

| task | accuracy | chance |
|---|---|---|
{rows}

## Curriculum

- KV retrieval, `"Memorize the following dictionary:\\nkey:value\\n...The value of the key 'key' is"`,
  1-{max_pairs} pairs, 200 English nouns as keys, values 0-99, up to {queries} queries per dictionary
  (distinct keys; with 8 pairs or fewer every key is queried once).
- A world of 300 facts (100 made-up entities x color / city / food) asked bare
  (`"What color is Bomek?\\nAnswer: red"`), as multiple choice scored on the text (cloze) and, for
  240 of the facts, on the letter. The other 60 facts are never trained in letter format.
- Loss on answer tokens only. Reproduce with `gna-lens train-zoo {name}`.
"""


#: The card's words for a recipe's non-default initializations.
_INIT_NOTES = {
    "mamba2_init": "Mamba-2 init of the SSM mixers",
    "fan_in_init": "linear layers with torch's default (fan-in) init",
    "zero_init_residual": "attention and MLP output projections initialized at zero",
}


def _init_note(train_facts: dict[str, Any]) -> str:
    """The card's words for a recipe's non-default initializations (empty when none)."""
    notes = [note for key, note in _INIT_NOTES.items() if train_facts.get(key)]
    if train_facts.get("embedding_std") is not None:
        notes.append(f"embeddings N(0, {train_facts['embedding_std']})")
    return "".join("; " + n for n in notes)


def _write_card(path: str | Path, name: str, train_facts: dict[str, Any], accuracies: dict) -> dict:
    """Write ``card.json`` and ``README.md`` into the checkpoint folder ``path``."""
    from transformers import AutoTokenizer

    path = Path(path)
    recipe = RECIPES.get(name)
    card = {
        "name": name,
        "description": recipe.description if recipe else "",
        **_model_facts(path),
        "training": train_facts,
        "eval": {
            "seed": EVAL_SEED,
            "kv_samples": KV_EVAL_SAMPLES,
            "mc_draws": MC_EVAL_DRAWS,
            "scoring": "choices",
        },
        "accuracy": accuracies,
    }
    (path / "card.json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    rows = "\n".join(
        f"| {k} | {v['accuracy'] * 100:.1f}% | {v['chance'] * 100:.1f}% |"
        for k, v in accuracies.items()
    )
    loader = (
        "a HookedSSM"
        if card["model_type"] in ("mamba", "mamba2", "bamba")
        else "a TransformerBridge"
    )
    readme = _README.format(
        **train_facts,  # n_params, steps, batch_size, lr, seed, threads, final_loss
        name=name,
        description=card["description"],
        loader=loader,
        architecture=card["architecture"],
        model_type=card["model_type"],
        minutes=train_facts["train_seconds"] / 60,
        kv_pct=100 * train_facts.get("kv_fraction", 0.5),
        init=_init_note(train_facts),
        vocab=len(AutoTokenizer.from_pretrained(path)),
        kv_n=KV_EVAL_SAMPLES,
        seed_eval=EVAL_SEED,
        mc_n=accuracies["letter"]["n"],
        unseen_n=accuracies.get("letter-unseen", {}).get("n", 0),
        draws=MC_EVAL_DRAWS,
        rows=rows,
        max_pairs=KV_MAX_PAIRS,
        queries=KV_QUERIES,
    )
    (path / "README.md").write_text(readme, encoding="utf-8")
    return card


def train_zoo_main(argv: Sequence[str] | None = None) -> int:
    """``gna-lens train-zoo``: train zoo models and write their checkpoints and cards.

    Args:
        argv: Command-line arguments (``--help`` lists them).

    Returns:
        The exit status.
    """
    from gna_lens.zoo import MODELS_DIR

    parser = argparse.ArgumentParser(
        prog="gna-lens train-zoo",
        description="Train the zoo's models on the synthetic curriculum (CPU, one thread each).",
    )
    parser.add_argument(
        "names", nargs="*", help=f"models to train (default: all of {list(RECIPES)})"
    )
    parser.add_argument(
        "--out", default="zoo_models",
        help="folder receiving <name>/ (default: ./zoo_models; the shipped checkpoints are "
        f"replaced only when this names their folder, {MODELS_DIR})",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="override each recipe's steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--eval-every", type=int, default=500, help="steps between quick held-out evals (500)"
    )
    parser.add_argument(
        "--card-only", action="store_true", help="re-measure existing checkpoints' cards"
    )
    args = parser.parse_args(argv)
    names = args.names or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown zoo models {unknown}; expected some of {list(RECIPES)}")
    torch.set_num_threads(args.threads)
    for name in names:
        out = Path(args.out) / name
        if args.card_only:
            old = json.loads((out / "card.json").read_text(encoding="utf-8"))
            facts = old["training"]
        else:
            facts = train_model(RECIPES[name], out, steps=args.steps, eval_every=args.eval_every)
        acc = measure(out)
        _write_card(out, name, facts, acc)
        summary = ", ".join(f"{k} {v['accuracy'] * 100:.1f}%" for k, v in acc.items())
        print(
            f"{name}: {facts['n_params']:,} params, {facts['steps']} steps, "
            f"{facts['train_seconds'] / 60:.1f} min; {summary}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(train_zoo_main())
