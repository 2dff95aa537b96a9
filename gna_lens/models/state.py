"""What a model keeps per sequence while generating: recurrent states and KV cache, in bytes
(:func:`state_bytes`), for any HookedSSM (Mamba-1, Mamba-2, hybrids, Llamba, hybrid students,
swapped heads), a TransformerBridge or a Hugging Face Llama-style model."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gna_lens.device import HOST
from gna_lens.errors import ConfigError
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.mixers import Attention, Mamba1Mixer, Mamba2Mixer
from gna_lens.models.mixers.hybrid import HybridMixer
from gna_lens.models.mixers.swapped import SwappedMamba2Mixer
from gna_lens.models.mixers.teacher_heads import TeacherHeadsMixer

__all__ = ["DEFAULT_LENGTHS", "StateBytes", "state_bytes"]

#: The sequence lengths :class:`StateBytes` reports by default.
DEFAULT_LENGTHS = (128, 2048, 4096)


@dataclass(frozen=True)
class StateBytes:
    """What a model keeps per sequence while generating, in bytes.

    The SSM heads' recurrent states have a fixed size; the attention heads' KV cache grows by
    ``kv_bytes_per_token`` per token. Per length ``L``: ``kv_bytes(L) = kv_bytes_per_token * L``,
    ``total_bytes(L) = recurrent_bytes + kv_bytes(L)``, ``bytes_per_token(L) = total_bytes(L) / L``.

    Attributes:
        model: The model's name.
        attention_heads: Query heads that attend (over all layers).
        ssm_heads: SSM heads (Mamba-1: channels).
        kv_heads: KV heads whose keys and values are cached (over all layers).
        element_bytes: Bytes per stored number (the dtype's size).
        recurrent_bytes: The recurrent states (SSM heads' ``[d_head, d_state]`` states, and the
            convolution windows of Mamba layers), per sequence.
        kv_bytes_per_token: Keys and values of one token, all layers.
        lengths: The lengths :meth:`to_dataframe` reports.
    """

    model: str
    attention_heads: int
    ssm_heads: int
    kv_heads: int
    element_bytes: int
    recurrent_bytes: int
    kv_bytes_per_token: int
    lengths: tuple[int, ...] = DEFAULT_LENGTHS

    def kv_bytes(self, length: int) -> int:
        """The KV cache after ``length`` tokens."""
        return self.kv_bytes_per_token * int(length)

    def total_bytes(self, length: int) -> int:
        """Recurrent states plus KV cache after ``length`` tokens."""
        return self.recurrent_bytes + self.kv_bytes(length)

    def bytes_per_token(self, length: int) -> float:
        """:meth:`total_bytes` divided by ``length``."""
        return self.total_bytes(length) / int(length)

    def to_dataframe(self) -> Any:
        """One row per length: recurrent-state, KV-cache and total bytes, bytes per token."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "model": self.model,
                    "length": L,
                    "attention_heads": self.attention_heads,
                    "ssm_heads": self.ssm_heads,
                    "recurrent_bytes": self.recurrent_bytes,
                    "kv_cache_bytes": self.kv_bytes(L),
                    "total_bytes": self.total_bytes(L),
                    "bytes_per_token": self.bytes_per_token(L),
                }
                for L in self.lengths
            ]
        )


def state_bytes(
    model: torch.nn.Module,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    dtype: torch.dtype | None = None,
) -> StateBytes:
    """Recurrent-state and KV-cache bytes of ``model`` while generating.

    Args:
        model: A hybrid student or any HookedSSM, a TransformerBridge, or a Hugging Face
            Llama-style model (the teacher).
        lengths: Sequence lengths to report (``StateBytes.to_dataframe``).
        dtype: The dtype the states are kept in (default: the model's parameters').

    Returns:
        A :class:`StateBytes`.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> sb = state_bytes(tiny_hooked_ssm("bamba"))
        >>> sb.kv_bytes_per_token, sb.total_bytes(128) == sb.recurrent_bytes + 128 * sb.kv_bytes_per_token
        (128, True)
    """
    lengths = tuple(int(L) for L in lengths)
    if not lengths or any(L < 1 for L in lengths):
        raise ConfigError(f"state_bytes(lengths={lengths!r}); expected positive lengths.")
    if dtype is None:
        dtype = next(iter(model.parameters())).dtype
    size = torch.empty((), dtype=dtype, device=HOST).element_size()
    name = str(getattr(getattr(model, "cfg", None), "model_name", "") or type(model).__name__)
    attn = ssm = kv = recurrent = 0  # kv and recurrent in numbers, not bytes
    kv_width = 0
    if isinstance(model, HookedSSM):
        cfg = model.cfg
        for block in model.blocks:
            mixer = getattr(block, "mixer", None)
            if isinstance(mixer, HybridMixer):
                attn += len(mixer.attn_heads)
                ssm += len(mixer.ssm_heads)
                kv += len(mixer.kv_heads)
                kv_width += 2 * len(mixer.kv_heads) * cfg.d_head
                recurrent += len(mixer.ssm_heads) * cfg.d_head * cfg.d_state
            elif isinstance(mixer, Mamba2Mixer):  # with the heads of swap_(teacher_)heads
                n_attn = len(getattr(mixer, "attn_heads", ()))
                attn += n_attn
                ssm += cfg.n_heads - n_attn
                # Without an output norm (Llamba) a teacher head's SSM state is never read; with
                # Mamba-2's gated group norm it still is (its y enters its group's norm).
                swapped = isinstance(mixer, SwappedMamba2Mixer)
                kept = cfg.n_heads - n_attn if swapped or cfg.mamba_norm == "none" else cfg.n_heads
                recurrent += kept * cfg.d_head * cfg.d_state + (cfg.d_conv - 1) * mixer.conv_dim
                if isinstance(mixer, SwappedMamba2Mixer):  # keys [d_state], values [d_head]
                    kv += n_attn
                    kv_width += n_attn * (cfg.d_state + cfg.d_head)
                    recurrent += (cfg.d_conv - 1) * n_attn * mixer.width
                elif isinstance(mixer, TeacherHeadsMixer):
                    kv += len(mixer.kv_heads)
                    kv_width += 2 * len(mixer.kv_heads) * cfg.d_head
            elif isinstance(mixer, Mamba1Mixer):
                ssm += cfg.d_inner
                recurrent += cfg.d_inner * cfg.d_state + (cfg.d_conv - 1) * cfg.d_inner
            if isinstance(getattr(block, "attn", None), Attention):
                attn += cfg.n_attn_heads
                kv += cfg.n_attn_kv_heads
                kv_width += 2 * cfg.n_attn_kv_heads * cfg.attn_d_head
    else:
        hf = getattr(model, "original_model", None) or model
        config = getattr(hf, "config", None)
        if config is None or not hasattr(config, "num_hidden_layers"):
            raise ConfigError(
                f"state_bytes got a {type(model).__name__}; expected a HookedSSM, a "
                "TransformerBridge or a Hugging Face causal LM with a config."
            )
        n, H = int(config.num_hidden_layers), int(config.num_attention_heads)
        KV = int(getattr(config, "num_key_value_heads", None) or H)
        d = int(getattr(config, "head_dim", None) or config.hidden_size // H)
        attn, kv, kv_width = n * H, n * KV, n * 2 * KV * d
    return StateBytes(
        model=name,
        attention_heads=attn,
        ssm_heads=ssm,
        kv_heads=kv,
        element_bytes=size,
        recurrent_bytes=recurrent * size,
        kv_bytes_per_token=kv_width * size,
        lengths=lengths,
    )
