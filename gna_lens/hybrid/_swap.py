"""Swap SSM heads of a pretrained Mamba-2 (or Mamba-2 hybrid) for attention heads, and train only
the new parameters: :func:`swap_heads`."""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gna_lens.errors import ConfigError
from gna_lens.hybrid._budget import parse_budget
from gna_lens.hybrid._data import default_distill_data, describe_data
from gna_lens.hybrid._distill import _layer_params, _result
from gna_lens.hybrid._layer_swap import _copy
from gna_lens.hybrid._pairs import Head, by_layer, head_pairs
from gna_lens.hybrid._train import Loop, loss_stage, run_stages
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.mixers.swapped import SwappedMamba2Mixer
from gna_lens.render.markdown import heads_label

__all__ = ["swap_heads"]


def _check_heads(model: HookedSSM, heads: Any) -> dict[int, list[int]]:
    cfg = model.cfg
    ssm_layers = [i for i, t in enumerate(cfg.layer_types) if t == "ssm"]
    where = (
        f"the model's SSM layers are {ssm_layers} with {cfg.n_heads} heads each "
        f"(0..{cfg.n_heads - 1})"
    )
    items = head_pairs(heads, "swap_heads(heads", where)
    if not items:
        raise ConfigError(f"swap_heads(heads=[]): no head to swap ({where}).")
    for layer, head in items:
        if layer not in ssm_layers or not 0 <= head < cfg.n_heads:
            raise ConfigError(
                f"swap_heads(heads=...) contains ({layer}, {head}), not an SSM head: {where}."
            )
        mixer = model.blocks[layer].mixer
        if isinstance(mixer, SwappedMamba2Mixer):
            raise ConfigError(
                f"swap_heads: layer {layer} already has swapped heads {mixer.attn_heads}; swap all "
                "the heads of a layer in one call, on the model before any swap."
            )
    return by_layer(items)


def swap_heads(
    model: HookedSSM,
    heads: Iterable[Head],
    *,
    train_data: Iterable[str] | None = None,
    budget: Any = "100k tokens",
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int = 8,
    max_length: int = 256,
    warmup: int = 10,
    grad_clip: float = 1.0,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    checkpoint_every: int = 50,
    max_steps: int | None = None,
    progress: bool = True,
) -> HookedSSM:
    """A copy of ``model`` whose ``heads`` are attention heads, their new parameters trained.

    Each swapped head becomes a causal softmax attention head with its own query / key / value
    projections and convolution, started from the head's own ``C`` / ``B`` / ``x`` rows of
    ``in_proj`` and convolution channels (``q <- C`` of its group, ``k <- B``, ``v <- x``; see
    :class:`~gna_lens.models.mixers.swapped.SwappedMamba2Mixer`). Only those new parameters
    train (next-token cross-entropy on ``train_data``, AdamW, warm-up then cosine over the
    budget); every other parameter keeps its value bit for bit. The result is a HookedSSM with
    the usual hooks: :func:`~gna_lens.head_view` gives the swapped heads kind ``"attention"``,
    ``hook_pattern`` holds their softmax pattern (editable), ``save_pretrained`` writes it and
    :func:`~gna_lens.load_model` reads it back. ``budget``, ``seed``, ``batch_size``,
    ``max_length``, ``warmup``, ``grad_clip``, ``checkpoint_dir``, ``resume``,
    ``checkpoint_every``, ``max_steps`` and ``progress`` are :func:`~gna_lens.hybrid.distill`'s.

    Args:
        model: A HookedSSM whose chosen layers are Mamba-2 layers (Mamba-2, Bamba, Nemotron-H,
            Granite 4.0, Falcon-H1); it is not modified.
        heads: ``(layer, head)`` pairs to swap.
        train_data: Texts (any iterable of str); ``None``:
            :func:`~gna_lens.hybrid.default_distill_data` ``(model.tokenizer, seed)`` (for a
            zoo model, its KV-retrieval texts).
        lr: Peak learning rate.

    Returns:
        The new model (eval mode); ``model.gna_swap`` says what was done (JSON-ready, saved with
        it) and ``model.gna_swap_result`` holds the training record (a
        :class:`~gna_lens.hybrid.DistillResult` with stage ``"swap"``).

    Raises:
        ConfigError: For heads that are not SSM heads of Mamba-2 layers, a layer swapped
            before, a bad budget, or no tokenizer.

    Examples:
        >>> from gna_lens import head_view
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> texts = ["a b c d e f g h"] * 40
        >>> swapped = swap_heads(model, [(1, 0)], train_data=texts, budget=200, progress=False)
        >>> head_view(swapped).kind_of((1, 0)), head_view(swapped).kind(1), head_view(model).kind(1)
        ('attention', 'mixed', 'ssm')
    """
    if not isinstance(model, HookedSSM):
        raise ConfigError(
            f"swap_heads(model={type(model).__name__}); expected a HookedSSM (a Mamba-2 or "
            "Mamba-2 hybrid loaded with gna_lens.load_model)."
        )
    per_layer = _check_heads(model, heads)
    total = parse_budget(budget)
    loop = Loop(
        "swap_heads", batch_size, max_length, warmup, checkpoint_dir, resume, progress, max_steps,
        checkpoint_every,
    )  # fmt: skip
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ConfigError("swap_heads: the model has no tokenizer (model.tokenizer is None).")
    from gna_lens.models.families.gna_swapped import install

    new = _copy(model)
    install(new, per_layer)
    new.eval()
    params = [np for i in per_layer for np in _layer_params(new, i, ("attn_proj", "attn_conv"))]
    if train_data is None:
        train_data = default_distill_data(tokenizer, seed)
    swapped = [(layer, h) for layer, hs in per_layer.items() for h in hs]
    word = "new attention heads " + heads_label(swapped, ", ")

    def lm_loss(ids: Tensor, mask: Tensor) -> Tensor:
        logits = new(ids)[:, :-1].float()
        target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    torch.manual_seed(seed)
    settings = {
        "heads": [list(h) for h in swapped],
        "budget": total.to_dict(),
        "seed": seed,
        "lr": lr,
        "batch_size": batch_size,
        "max_length": max_length,
        "warmup": warmup,
        "grad_clip": grad_clip,
    }
    stage = loss_stage("swap", params, lm_loss, total, lr, word, grad_clip)
    device = next(iter(new.parameters())).device
    outcome = run_stages(
        new, [stage], train_data, tokenizer, loop, fingerprint=settings, device=device
    )
    from gna_lens.models.provenance import provenance_of

    prov = provenance_of(model)
    source = {
        "name": str(model.cfg.model_name or ""),
        "architecture": model.cfg.architecture,
        "provenance": prov.describe() if prov.known else "",
    }
    method = settings | {
        "data": describe_data(train_data),
        "loss": "next-token cross-entropy on every token of the texts",
        "optimizer": "AdamW (betas 0.9, 0.98, no weight decay), linear warm-up then cosine to "
        "lr / 10 over the budget",
        "init": "q <- C rows of the head's group, k <- B rows, v <- x rows of in_proj, with the "
        "same channels' causal convolution and SiLU; softmax scale 1/sqrt(d_state)",
        "source": source,
        "torch_threads": torch.get_num_threads(),
    }
    n_trained = {"swap": sum(p.numel() for _, p in params)}
    result = _result(outcome, (), total, seed, {"swap": word}, n_trained, method)
    new.gna_swap = method | {  # type: ignore[assignment]
        "probe": result.probe,
        "totals": result.totals,
        "n_trained": result.n_trained["swap"],
        "complete": result.complete,
    }
    new.gna_swap_result = result  # type: ignore[assignment]
    return new
