"""HookedSSM: Mamba-1, Mamba-2 and the Bamba, Nemotron-H, Granite 4.0, Falcon-H1, Jamba and Zamba2
hybrids with TransformerLens hooks.

The model assembles the blocks of its family (:mod:`gna_lens.models.families`): each block holds
mixers of :mod:`gna_lens.models.mixers`, re-implemented in PyTorch (kernels in
:mod:`gna_lens.models.ops`) so that every intermediate is a
:class:`~transformer_lens.hook_points.HookPoint` and so that the implicit attention of each SSM
layer can be materialized as an *editable* ``hook_pattern``: when anything hooks
``blocks.{l}.mixer.hook_pattern`` that layer computes ``y = pattern @ x + D x`` from the (possibly
edited) matrix; otherwise it runs a fast scan.
"""

import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from gna_lens.device import HOST
from gna_lens.errors import ConfigError, HookError, InterventionError
from gna_lens.models import ops
from gna_lens.models.block import SSMBlock
from gna_lens.models.config import SSMConfig
from gna_lens.models.families import FAMILIES, checkpoint_family, family_of
from gna_lens.models.families import convert_hf_state_dict as _convert_hf_state_dict
from gna_lens.models.mixers.base import RMSNorm, SSMMixer, StepState

__all__ = ["HookedSSM", "SSMPrefix"]

#: Mamba-1 channel groups: ``None`` (single channels), an int (contiguous blocks of that many
#: channels in every SSM layer) or ``{layer: int | [[channel, ...], ...]}``.
HeadGroupsSpec = int | Mapping[int, int | Sequence[Sequence[int]]] | None


@dataclass
class SSMPrefix:
    """What the last token of each prompt needs from its prefix, per layer
    (:meth:`HookedSSM.prefix_state`)."""

    last: Tensor  # [G, 1] last token ids
    length: int  # full prompt length L
    layers: list[StepState]
    expanded: dict[int, list[StepState]] = field(default_factory=dict)

    def for_copies(self, K: int) -> list[StepState]:
        """The layers' states repeated for ``K`` packed copies (cell-major; one packing kept)."""
        if K == 1:
            return self.layers
        if K not in self.expanded:
            self.expanded = {
                K: [
                    {k: v.repeat(K, *([1] * (v.ndim - 1))) for k, v in layer.items()}
                    for layer in self.layers
                ]
            }
        return self.expanded[K]


ReturnType = Literal["logits", "loss", "both"] | None
ModelInput = str | list[str] | Int[Tensor, "batch pos"] | Float[Tensor, "batch pos d_model"]


class SSMActivationCache(ActivationCache):
    """TransformerLens's ``ActivationCache`` whose shorthand keys also find HookedSSM's names.

    ``cache["pattern", L]``, ``cache["resid_post", -1]`` and the other
    ``transformer_lens.utilities.get_act_name`` shorthands work as on a TransformerBridge: on an
    SSM layer, a name under ``blocks.L.attn.`` is read from ``blocks.L.mixer.`` (``"pattern"``:
    the materialized implicit attention) and ``"attn_out"`` from ``blocks.L.hook_mixer_out``;
    attention layers of hybrids keep TransformerLens's names.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> _, cache = model.run_with_cache(model.to_tokens("a b c"))
        >>> cache["pattern", 0] is cache["blocks.0.mixer.hook_pattern"]
        True
        >>> cache["resid_post", -1].shape == cache["blocks.1.hook_resid_post"].shape
        True
    """

    def __getitem__(self, key: Any) -> Tensor:
        if key in self.cache_dict:
            return self.cache_dict[key]
        from transformer_lens.utilities import get_act_name

        if isinstance(key, str):
            name = get_act_name(key)
        else:
            parts = list(key)
            if len(parts) > 1 and parts[1] is not None and parts[1] < 0:
                parts[1] += self.model.cfg.n_layers
            name = get_act_name(*parts)
        for candidate in (name, *_ssm_names(name)):
            if candidate in self.cache_dict:
                return self.cache_dict[candidate]
        raise KeyError(
            f"cache[{key!r}]: no {name!r} (nor its SSM name) in this cache of "
            f"{len(self.cache_dict)} activations; cached names look like "
            f"{sorted(self.cache_dict)[:4]}. Fix: cache it (run_with_cache without names_filter, "
            "or with this name), or use a name of docs/hook_points.md."
        )


def _ssm_names(name: str) -> tuple[str, ...]:
    """An SSM layer's names for a TransformerLens attention name (``blocks.L.attn.X``)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "blocks" and parts[2] == "hook_attn_out":
        return (f"blocks.{parts[1]}.hook_mixer_out",)
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "attn":
        return (f"blocks.{parts[1]}.mixer.{parts[3]}",)
    return ()


class HookedSSM(HookedRootModule):
    """A Mamba-family language model with TransformerLens hooks and editable implicit attention.

    Supports ``MambaForCausalLM``, ``FalconMambaForCausalLM``, ``Mamba2ForCausalLM`` and the
    hybrids ``BambaForCausalLM``, ``NemotronHForCausalLM``, ``GraniteMoeHybridForCausalLM``,
    ``FalconH1ForCausalLM`` (attention beside the SSM mixer in every layer) and
    ``JambaForCausalLM`` (Mamba-1 and attention layers, MoE MLPs), ``Zamba2ForCausalLM``
    (shared transformer blocks invoked before some layers' mixers), and the hybrid students of
    :func:`gna_lens.hybrid.build_hybrid` (each head of a Llama teacher kept as attention or
    turned into an SSM head; :meth:`save_pretrained` writes them).
    Logits match Hugging Face's to about 1e-6 in fp32.

    Hook points: ``hook_embed``, ``blocks.{l}.hook_resid_pre`` / ``hook_resid_post``, SSM layers'
    ``blocks.{l}.mixer.hook_*``, attention layers' ``blocks.{l}.attn.hook_*`` and the hybrids'
    MLPs; every name and shape is in docs/hook_points.md (``model.hook_dict`` lists them).

    Execution paths: see the module docstring; :meth:`pattern_selection` restricts
    materialization to some heads and query positions.

    Mamba-1 heads are single channels (``d_inner`` per layer) unless :meth:`set_head_groups` /
    :meth:`head_groups` make groups of channels the heads of every function that takes heads.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> model = tiny_hooked_ssm("mamba2")
        >>> logits, cache = model.run_with_cache("a b c", names_filter=lambda n: "pattern" in n)
        >>> cache["blocks.0.mixer.hook_pattern"].shape[1] == model.cfg.n_heads
        True
    """

    cfg: SSMConfig

    def __init__(self, cfg: SSMConfig, tokenizer: Any | None = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        build = family_of(cfg.architecture).build_blocks
        blocks = build(cfg) if build else [SSMBlock(cfg, layer) for layer in range(cfg.n_layers)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.weight
        if self._uses_rope:
            inv_freq = ops.rope_inv_freq(
                cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling, device=self.embed.weight.device
            )
            self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        #: Resolved Mamba-1 channel groups, ``{layer: ((channel, ...), ...)}``; empty: every
        #: channel is its own head. Set with :meth:`set_head_groups` / :meth:`head_groups`.
        self._head_groups: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.setup()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Any | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> "HookedSSM":
        """Build a HookedSSM from a loaded Hugging Face model (weights are copied).

        Args:
            hf_model: A model of a supported family (``MambaForCausalLM``, ...,
                ``JambaForCausalLM``; see :data:`~gna_lens.models.SUPPORTED_MODEL_TYPES`).
            tokenizer: Its tokenizer (optional; needed for string inputs).
            dtype: Target dtype (default: the HF model's).
            device: Target device (default: the HF model's).

        Returns:
            The HookedSSM in eval mode.

        Raises:
            ConfigError: If the architecture is not supported.
        """
        config = getattr(hf_model, "config", None)
        if config is None:
            raise ConfigError(
                f"from_hf_model expects a Hugging Face PreTrainedModel with a .config; got "
                f"{type(hf_model).__name__}."
            )
        cfg = SSMConfig.from_hf_config(config)
        state = _convert_hf_state_dict(cfg, hf_model.state_dict())
        first = next(iter(hf_model.parameters()))
        cfg.dtype = dtype or first.dtype
        cfg.device = str(device or first.device)
        model = cls(cfg, tokenizer)
        model.load_state_dict(state, strict=True)
        return model.to(device=cfg.device, dtype=cfg.dtype).eval()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tokenizer: Any | None = None,
        **hf_kwargs: Any,
    ) -> "HookedSSM":
        """Load a Hugging Face checkpoint (hub name, or local directory) into a HookedSSM.

        Args:
            name_or_path: A hub name of a ``transformers``-format checkpoint
                (``state-spaces/mamba-130m-hf``) or a local directory holding ``config.json``
                and weights. Checkpoints in mamba_ssm's original format
                (``state-spaces/mamba2-130m``) load through :func:`gna_lens.load_model`, which
                converts them.
            dtype: Weights dtype; fp32 (default) or fp64 for exact pattern edits.
            device: Target device.
            tokenizer: A tokenizer to use instead of the checkpoint's.
            **hf_kwargs: Passed to ``AutoModelForCausalLM.from_pretrained``.

        Returns:
            The HookedSSM in eval mode.

        Raises:
            ConfigError: If the checkpoint's architecture is not supported.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        own = checkpoint_family(name_or_path)
        if own is not None and own.load is not None:  # gna_lens's own format (hybrid students)
            if hf_kwargs:
                raise ConfigError(
                    f"HookedSSM.from_pretrained({str(name_or_path)!r}): option(s) "
                    f"{sorted(hf_kwargs)} do not apply to a {own.model_type} checkpoint (gna_lens "
                    "reads it, not transformers); accepted: dtype, device, tokenizer."
                )
            loaded: HookedSSM = own.load(
                Path(name_or_path), dtype=dtype, device=device, tokenizer=tokenizer
            )
            return loaded
        config = AutoConfig.from_pretrained(name_or_path)
        SSMConfig.from_hf_config(config)  # fail early, before loading weights
        hf_model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **hf_kwargs)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            except (OSError, ValueError):
                tokenizer = None
        model = cls.from_hf_model(hf_model, tokenizer, dtype=dtype, device=device)
        model.cfg.model_name = str(name_or_path)
        return model

    def save_pretrained(self, path: str | Path) -> Path:
        """Save the model to the folder ``path`` (weights, config, tokenizer), for the families
        whose checkpoints are gna_lens's own format: the hybrid students of
        :func:`gna_lens.hybrid.build_hybrid` and the models with heads swapped by
        :func:`gna_lens.hybrid.swap_heads`. :func:`gna_lens.load_model` and
        :meth:`from_pretrained` read it back bit-identically.

        Returns:
            The folder.

        Raises:
            ConfigError: For a model of another family (it loads from its Hugging Face
                checkpoint; there is nothing of gna_lens's to save).
        """
        for layer, mixer in self.ssm_mixers().items():
            if mixer.unsaved_reason:
                raise ConfigError(
                    f"save_pretrained({str(path)!r}): layer {layer} of this "
                    f"{self.cfg.architecture} model cannot be saved: {mixer.unsaved_reason}."
                )
        family = family_of(self.cfg.architecture)
        claims = [f for f in FAMILIES.values() if f.saves is not None and f.saves(self)]
        family = claims[0] if claims else family  # e.g. a model with swapped heads
        if family.save is None:
            own = sorted(f.model_type for f in FAMILIES.values() if f.save is not None)
            raise ConfigError(
                f"save_pretrained: this is a {family.hf_class} ({self.cfg.architecture}), which "
                "loads from its Hugging Face checkpoint (save the transformers model instead). "
                f"HookedSSM writes only the families of gna_lens's own format: {own}."
            )
        folder = Path(path)
        family.save(self, folder)
        return folder

    # ------------------------------------------------------------------ hooks
    def _check_hook_name(self, name: Any) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.6)
            hint = f" Did you mean {close}?" if close else ""
            raise HookError(
                f"{type(self).__name__} ({self.cfg.architecture}, {self.cfg.n_layers} layers) has no "
                f"hook point named {name!r}.{hint} List them with model.hook_dict.keys()."
            )

    def add_hook(self, name: Any, hook: Callable, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._check_hook_name(name)
        super().add_hook(name, hook, *args, **kwargs)

    def _enable_hook_with_name(self, name: str, hook: Callable, dir: Literal["fwd", "bwd"]) -> None:
        self._check_hook_name(name)
        super()._enable_hook_with_name(name, hook, dir)

    def run_with_cache(  # type: ignore[override]
        self, *model_args: Any, names_filter: Any = None, **kwargs: Any
    ) -> tuple[Any, ActivationCache]:
        """Run the model and return ``(output, ActivationCache)``; see TransformerLens."""
        names = [names_filter] if isinstance(names_filter, str) else names_filter
        for name in names if isinstance(names, list) else []:
            self._check_hook_name(name)
        out, cache = super().run_with_cache(*model_args, names_filter=names_filter, **kwargs)
        has_batch = not kwargs.get("remove_batch_dim", False)
        return out, SSMActivationCache(cache, self, has_batch_dim=has_batch)

    @contextmanager
    def pattern_selection(
        self,
        heads: Sequence[int] | dict[int, Sequence[int]] | None = None,
        query_positions: Sequence[int] | Literal["last"] | None = None,
    ) -> Iterator["HookedSSM"]:
        """Materialize only some heads and query rows of the SSM patterns inside the block.

        The ``hook_pattern`` tensors then have shape ``[batch, len(heads), len(rows), key_pos]``
        (rows sorted, negative positions counted from the end); the other heads and rows run on
        the fast path. The indices used are in ``blocks[l].mixer.last_pattern_index``.

        Args:
            heads: Heads for every SSM layer, or ``{layer: heads}``; ``None`` for all heads.
            query_positions: Query positions, ``"last"`` for the final one, ``None`` for all.

        Yields:
            The model.

        Examples:
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba2")
            >>> with model.pattern_selection(heads=[0], query_positions="last"):
            ...     _, cache = model.run_with_cache("a b c d", names_filter="blocks.0.mixer.hook_pattern")
            >>> tuple(cache["blocks.0.mixer.hook_pattern"].shape[1:3])
            (1, 1)
        """
        rows = [-1] if query_positions == "last" else query_positions
        if rows is not None and (
            isinstance(rows, str)
            or not rows
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
        ):
            raise InterventionError(
                f"pattern_selection: query_positions={query_positions!r}; expected 'last', None or "
                "a non-empty list of int positions (negative counts from the end)."
            )
        mixers = self.ssm_mixers()
        per_layer = self._selection_heads(heads, list(mixers))
        device = self.embed.weight.device
        saved = {i: (m.pattern_heads, m.pattern_rows) for i, m in mixers.items()}
        try:
            for i, m in mixers.items():
                layer_heads = per_layer.get(i)
                if layer_heads is not None:
                    m.pattern_heads = torch.tensor(layer_heads, dtype=torch.long, device=device)
                m.pattern_rows = None if rows is None else list(rows)
            yield self
        finally:
            for i, m in mixers.items():
                m.pattern_heads, m.pattern_rows = saved[i]

    def _selection_heads(
        self, heads: Sequence[int] | dict[int, Sequence[int]] | None, ssm_layers: list[int]
    ) -> dict[int, list[int]]:
        """Validate ``pattern_selection(heads=...)``; the sorted heads of each selected layer."""
        n = self.cfg.n_heads
        if heads is None:
            return {}
        if isinstance(heads, dict):
            bad_layers = [k for k in heads if k not in ssm_layers]
            if bad_layers:
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): layers {bad_layers} are not SSM layers "
                    f"of this {self.cfg.architecture} model; its SSM layers are {ssm_layers} (of "
                    f"{self.cfg.n_layers}). Fix: key the dict by SSM layer indices (attention "
                    "layers of a hybrid need no selection: their pattern is always materialized)."
                )
            per = dict(heads)
        else:
            per = {i: heads for i in ssm_layers}
        out: dict[int, list[int]] = {}
        for i, layer_heads in per.items():
            if isinstance(layer_heads, int | str) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in layer_heads
            ):
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): layer {i} gets {layer_heads!r}; expected "
                    "a list of int head indices, e.g. heads=[0, 3] or heads={1: [0, 3]}."
                )
            bad = [h for h in layer_heads if not 0 <= h < n]
            if bad or not layer_heads:
                raise InterventionError(
                    f"pattern_selection(heads={heads!r}): heads {bad or '[]'} of layer {i} are "
                    f"out of range; the SSM layers have {n} heads (valid: 0 to {n - 1}). Fix: "
                    "pass heads in that range, or heads=None for all."
                )
            out[i] = sorted(set(layer_heads))
        return out

    # ------------------------------------------------------------------ channel groups
    @property
    def head_group_spec(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        """The current Mamba-1 channel groups, ``{layer: ((channel, ...), ...)}`` (a copy).

        Empty when every channel is its own head (the default). Layers not listed keep single
        channels.
        """
        return dict(getattr(self, "_head_groups", {}))

    def set_head_groups(self, groups: HeadGroupsSpec) -> None:
        """Make groups of Mamba-1 channels the heads of :func:`gna_lens.head_view`.

        Mamba-1 has no heads: each of its ``d_inner`` channels has its own implicit attention, so
        by default every channel is a head ``(layer, channel)`` (36,864 in mamba-130m). With
        groups, ``(layer, g)`` addresses group ``g`` of ``layer`` in every function that takes
        heads (ablation, sweeps, patching, attribution, masks, pattern scores, score_heads):
        ablating a group ablates all its channels, masking a group masks each of its channels'
        matrices, a group's attribution is the sum of its channels' and its pattern is the mean
        of its channels' row-normalized ``|α|`` (see :func:`gna_lens.heads.head_patterns`).

        The hook points do not change: ``hook_z`` and ``hook_pattern`` stay one entry per channel,
        and :meth:`pattern_selection` keeps taking channel indices. Use :meth:`head_groups` to
        group only inside a ``with`` block.

        Args:
            groups: ``None``: single channels (the default). An int ``k``: contiguous blocks of
                ``k`` channels in every SSM layer (``k`` must divide ``d_inner``; group ``g`` is
                channels ``g*k .. g*k+k-1``). A dict ``{layer: k}`` or ``{layer: [[c, ...], ...]}``:
                per layer, contiguous blocks or explicit disjoint channel sets (e.g. the small
                sets of channels reported as Mamba-1 G&A heads); a layer given explicit sets
                has exactly those heads, and layers not in the dict keep single channels.

        Raises:
            InterventionError: For a Mamba-2 / hybrid model (their SSM heads are real heads), or a
                malformed spec (a size that does not divide ``d_inner``, unknown layers,
                channels out of range, empty or overlapping sets).

        Examples:
            >>> from gna_lens import head_view
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba1")
            >>> head_view(model)[0].n_heads  # d_inner channels
            64
            >>> model.set_head_groups(16)
            >>> lh = head_view(model)[0]
            >>> lh.n_heads, lh.channels[1][:3]
            (4, (16, 17, 18))
            >>> model.set_head_groups({1: [[3, 40], [7]]})
            >>> [lh.n_heads for lh in head_view(model)]
            [64, 2]
            >>> model.set_head_groups(None)
        """
        self._head_groups = self._resolve_head_groups(groups)

    @contextmanager
    def head_groups(self, groups: HeadGroupsSpec) -> Iterator["HookedSSM"]:
        """:meth:`set_head_groups` inside a ``with`` block; the previous groups come back after.

        Examples:
            >>> from gna_lens import ablate_heads
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba1")
            >>> with model.head_groups(8), ablate_heads(model, [(0, 1)]):  # channels 8..15
            ...     logits = model("a b c")
            >>> model.head_group_spec
            {}
        """
        saved = self._head_groups
        self._head_groups = self._resolve_head_groups(groups)
        try:
            yield self
        finally:
            self._head_groups = saved

    def _resolve_head_groups(self, spec: HeadGroupsSpec) -> dict[int, tuple[tuple[int, ...], ...]]:
        cfg = self.cfg
        if spec is None:
            return {}
        if not self.channel_heads:
            raise InterventionError(
                f"set_head_groups({spec!r}): this is a {cfg.architecture} model; channel groups "
                "are for Mamba-1 layers (Mamba-1, FalconMamba, Jamba), whose heads are single "
                "channels. Mamba-2 heads "
                "(and attention heads) are real heads already: address them as (layer, head)."
            )
        layers = list(self.ssm_mixers())
        E = cfg.d_inner
        if isinstance(spec, int) and not isinstance(spec, bool):
            per: Mapping[int, Any] = {layer: spec for layer in layers}
        elif isinstance(spec, Mapping):
            per = spec
        else:
            raise InterventionError(
                f"set_head_groups({spec!r}); expected None, an int block size (e.g. 16) or a "
                "dict {layer: block size or [[channel, ...], ...]}."
            )
        out: dict[int, tuple[tuple[int, ...], ...]] = {}
        for layer, item in per.items():
            if layer not in layers:
                raise InterventionError(
                    f"set_head_groups: layer {layer!r} is not an SSM layer of this "
                    f"{cfg.n_layers}-layer model (SSM layers: {layers})."
                )
            if isinstance(item, int) and not isinstance(item, bool):
                if item <= 0 or E % item:
                    divisors = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if E % k == 0]
                    raise InterventionError(
                        f"set_head_groups: block size {item} for layer {layer} does not divide "
                        f"d_inner={E}; expected a divisor, e.g. one of {divisors}. (For groups "
                        "of uneven size pass explicit channel sets.)"
                    )
                out[layer] = tuple(tuple(range(g, g + item)) for g in range(0, E, item))
            else:
                out[layer] = self._channel_sets(layer, item, E)
        return out

    @staticmethod
    def _channel_sets(layer: int, item: Any, E: int) -> tuple[tuple[int, ...], ...]:
        bad_shape = isinstance(item, str | bytes) or not isinstance(item, Sequence) or not item
        if not bad_shape:
            bad_shape = any(
                isinstance(s, str | bytes)
                or not isinstance(s, Sequence | set | frozenset)
                or not s
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in s)
                for s in item
            )
        if bad_shape:
            raise InterventionError(
                f"set_head_groups: layer {layer} gets {item!r}; expected a block size or a "
                "non-empty list of non-empty channel lists, e.g. {layer: [[3, 17, 40], [5, 6]]}."
            )
        sets = tuple(tuple(sorted(set(s))) for s in item)
        flat = [c for s in sets for c in s]
        out_of_range = sorted({c for c in flat if not 0 <= c < E})
        if out_of_range:
            raise InterventionError(
                f"set_head_groups: layer {layer} lists channels {out_of_range}, out of range for "
                f"d_inner={E} (valid: 0 to {E - 1})."
            )
        if len(flat) != len(set(flat)):
            twice = sorted({c for c in flat if flat.count(c) > 1})
            raise InterventionError(
                f"set_head_groups: channels {twice} of layer {layer} are in more than one set; "
                "groups must be disjoint (ablate overlapping sets as head sets instead)."
            )
        return sets

    def ssm_mixers(self) -> dict[int, SSMMixer]:
        """The SSM mixer module of each SSM layer, keyed by layer index."""
        mixers = {i: getattr(block, "mixer", None) for i, block in enumerate(self.blocks)}
        return {i: m for i, m in mixers.items() if isinstance(m, SSMMixer)}

    @property
    def channel_heads(self) -> bool:
        """Whether the SSM heads are single channels (Mamba-1, FalconMamba, Jamba), which
        :meth:`set_head_groups` can group (``SSMMixer.channel_heads``).

        Examples:
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> tiny_hooked_ssm("mamba1").channel_heads, tiny_hooked_ssm("bamba").channel_heads
            (True, False)
        """
        return any(m.channel_heads for m in self.ssm_mixers().values())

    def gradient_path(self) -> str:
        """How a backward pass through the fast path runs, in words (for results' ``info``)."""
        notes = dict.fromkeys(
            m.backward_note for m in self.ssm_mixers().values() if m.backward_note
        )
        return "; ".join(["the model's own forward", *notes])

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input: ModelInput,
        *,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        return_type: ReturnType = "logits",
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        loss_per_token: bool = False,
        tokens: Int[Tensor, "batch pos"] | None = None,
    ) -> Any:
        """Run the model.

        Args:
            input: Text, a list of texts, token ids ``[batch, pos]``, or, with
                ``start_at_layer``, the residual stream ``[batch, pos, d_model]``.
            attention_mask: ``[batch, pos]`` with 0 on padding (computed for text input).
            return_type: ``"logits"``, ``"loss"``, ``"both"`` or ``None``.
            start_at_layer: Start from this block, treating ``input`` as its ``hook_resid_pre``.
            stop_at_layer: Stop before this block and return the residual stream.
            prepend_bos: For text input: prepend the BOS token (default: the tokenizer's own
                behaviour).
            padding_side: For a list of texts: ``"left"`` or ``"right"`` (default: the
                tokenizer's).
            loss_per_token: Return the per-token loss ``[batch, pos - 1]``.
            tokens: With ``start_at_layer``: the rows' token ids, for the blocks that read the
                token embeddings (Zamba2's shared transformer blocks); ``hook_embed`` fires on
                them only when a block that runs needs them.

        Returns:
            Logits ``[batch, pos, d_vocab]``, the loss, both, ``None``, or the residual stream when
            ``stop_at_layer`` is given.
        """
        self._check_layer_bound("start_at_layer", start_at_layer)
        self._check_layer_bound("stop_at_layer", stop_at_layer)
        blocks = self._blocks()[start_at_layer:stop_at_layer]
        embed: Tensor | None = None
        if start_at_layer is None:
            if isinstance(input, Tensor) and input.is_floating_point():
                raise ValueError(
                    f"HookedSSM.forward got a float tensor of shape {tuple(input.shape)} without "
                    "start_at_layer; pass token ids [batch, pos], or the residual stream together "
                    "with start_at_layer=k."
                )
            tokens, text_mask = self._tokens_and_mask(input, prepend_bos, padding_side)
            if attention_mask is None:
                attention_mask = text_mask
            resid = self.embed_tokens(tokens)
            if any(block.reads_embed for block in blocks):
                embed = resid.clone()  # a hook editing the residual in place leaves it as it is
        else:
            if not isinstance(input, Tensor) or input.ndim != 3:
                raise ValueError(
                    f"With start_at_layer={start_at_layer}, input must be the residual stream "
                    f"[batch, pos, d_model={self.cfg.d_model}]; got "
                    f"{tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__}."
                )
            resid = input
            if tokens is not None and any(block.reads_embed for block in blocks):
                embed = self._row_embeddings(tokens, resid)
            tokens = None  # no loss without token input
        mask = self._normalize_mask(attention_mask, resid.shape[:2])
        rope = self._rope(resid.shape[1], resid.device, resid.dtype) if self._uses_rope else None
        for block in blocks:
            resid = block(resid, mask, rope, embed)
        if stop_at_layer is not None:
            return resid
        logits = self.logits_of(resid)
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        if tokens is None:
            raise ValueError("return_type='loss' needs token input (not start_at_layer).")
        loss = _lm_loss(logits, tokens, mask, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type={return_type!r}; expected 'logits', 'loss', 'both' or None.")

    def _check_layer_bound(self, what: str, layer: int | None) -> None:
        n = self.cfg.n_layers
        if layer is None:
            return
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer <= n:
            raise InterventionError(
                f"{what}={layer!r} is out of range for this {n}-layer model; expected an int "
                f"from {-n} to {n} (negative counts from the end, {n} = after the last block). "
                f"Fix: pass a layer index of this model, or None."
            )

    def _row_embeddings(self, tokens: Tensor, resid: Tensor) -> Tensor:
        """``hook_embed`` of ``tokens`` ``[rows, pos]``, the ids of ``resid``'s rows."""
        if not isinstance(tokens, Tensor) or tuple(tokens.shape) != tuple(resid.shape[:2]):
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(
                f"tokens has shape {got}; expected the token ids of the residual stream's rows, "
                f"[batch, pos] = {tuple(resid.shape[:2])}."
            )
        return self.embed_tokens(tokens.to(self.embed.weight.device))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """``hook_embed``: the token embeddings (times Granite's embedding_multiplier)."""
        emb = self.embed(tokens)
        m = self.cfg.embedding_multiplier
        return cast("Tensor", self.hook_embed(emb if m == 1.0 else emb * m))

    def logits_of(self, resid: Tensor) -> Tensor:
        """Final norm and unembedding (logits divided by Granite's logits_scaling)."""
        logits = self.unembed(self.ln_final(resid.to(self.ln_final.weight.dtype)))
        s = self.cfg.logits_scaling
        return cast("Tensor", logits if s == 1.0 else logits / s)

    @property
    def _uses_rope(self) -> bool:
        """Whether attention layers or a mixer's attention heads (``SSMMixer.uses_rope``) need
        RoPE."""
        mixers = self.ssm_mixers().values()
        return bool(self.cfg.use_rope and (self.cfg.is_hybrid or any(m.uses_rope for m in mixers)))

    def _rope(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq: Tensor = self.rope_inv_freq  # type: ignore[assignment]
        freqs = torch.arange(length, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _normalize_mask(self, mask: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
        if mask is None:
            return None
        if tuple(mask.shape) != tuple(shape):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}; expected [batch, pos] = "
                f"{tuple(shape)} to match the input."
            )
        if bool((mask == 1).all()):
            return None
        return mask.to(self.embed.weight.device)

    # ------------------------------------------------------------------ incremental
    def _blocks(self) -> list[SSMBlock]:
        return list(self.blocks)  # type: ignore[arg-type]

    def prefix_state(
        self, tokens: Int[Tensor, "batch pos"]
    ) -> tuple[Float[Tensor, "batch d_vocab"], SSMPrefix]:
        """Run ``tokens`` once; return the last position's logits and what the last token needs
        from the earlier ones, so that :meth:`step` can recompute that token alone.

        Per layer the state is the mixers' ``prefix_state`` (SSM layers: the recurrent state
        after position ``L - 2`` and the last ``d_conv - 1`` convolution inputs; attention: the
        rotated keys and the values). The sweeps that edit only the last position use it.

        Args:
            tokens: Unpadded prompts ``[batch, pos]`` (``pos >= 2``).

        Returns:
            ``(logits [batch, d_vocab], state)``.

        Examples:
            >>> import torch
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("bamba")
            >>> tokens = model.to_tokens(["a b c d", "e f g h"])
            >>> with torch.no_grad():
            ...     logits, prefix = model.prefix_state(tokens)
            ...     again = model.step(prefix)
            >>> torch.allclose(again, logits, atol=1e-5), torch.allclose(logits, model(tokens)[:, -1], atol=1e-5)
            (True, True)
        """
        L = tokens.shape[1]
        store: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            store[hook.name] = x

        hooks: list[tuple[str | Callable, Callable]] = [
            (n, keep) for block in self._blocks() for n in block.prefix_hooks()
        ]
        with self.hooks(fwd_hooks=hooks):
            resid = self(tokens, stop_at_layer=self.cfg.n_layers)
        logits = self(resid[:, -1:], start_at_layer=self.cfg.n_layers)[:, 0]
        layers = [block.prefix_state(store, L - 1) for block in self._blocks()]
        return logits, SSMPrefix(last=tokens[:, -1:], length=L, layers=layers)

    def step(self, prefix: SSMPrefix, copies: int = 1) -> Float[Tensor, "rows d_vocab"]:
        """The last token's logits from ``prefix`` (:meth:`prefix_state`), for ``copies`` packed
        copies of its prompts (cell-major: ``[copies * batch, d_vocab]``).

        Every hook point of the model fires with ``pos = 1`` (the last position), so hooks on
        ``hook_z`` (ablation, patching) act on that position exactly as in the full forward.
        SSM ``hook_pattern`` / ``hook_ssm_state`` are not computed here: hooking them raises.

        Raises:
            InterventionError: If an SSM layer's ``hook_pattern`` or ``hook_ssm_state`` is
                hooked.
        """
        states = prefix.for_copies(copies)
        tok = prefix.last.repeat(copies, 1)
        resid = self.embed_tokens(tok)
        rope = None
        if self._uses_rope:
            cos, sin = self._rope(prefix.length, resid.device, resid.dtype)
            rope = (cos[-1:], sin[-1:])
        blocks = self._blocks()
        embed = resid.clone() if any(block.reads_embed for block in blocks) else None
        for block, state in zip(blocks, states, strict=True):
            resid = block.step(resid, state, rope, embed)
        logits = self.logits_of(resid)
        return logits[:, 0]

    @torch.no_grad()
    def generate(
        self,
        input: str | list[str] | Tensor,
        max_new_tokens: int = 16,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        stop_at_eos: bool = True,
        seed: int | None = None,
        return_type: Literal["str", "tokens"] | None = None,
    ) -> Any:
        """Continue ``input`` by up to ``max_new_tokens`` tokens (greedy, or sampled).

        Each new token comes from a full forward over the text so far, so every hook the user
        holds (``model.hooks(...)``) fires on every step exactly as in :meth:`forward`: an
        ablation or a pattern edit shapes the continuation. That costs a forward per token
        (quadratic in the length), fine for the short continuations interpretability looks at.

        Args:
            input: A text, a list of texts (left-padded), or token ids ``[batch, pos]``.
            max_new_tokens: How many tokens to add at most.
            do_sample: Sample from the softmax instead of taking the argmax.
            temperature: Softmax temperature when sampling (> 0).
            top_k: Sample among the ``top_k`` most likely tokens only.
            stop_at_eos: Stop a row once it produced the tokenizer's EOS (the row is then padded
                with EOS).
            seed: Seed of the sampling generator (on the model's device).
            return_type: ``"str"`` (default for text input) or ``"tokens"`` (default for token
                ids: ``[batch, pos + new]``).

        Returns:
            The continued text(s) (prompt included), or the token ids.

        Raises:
            ConfigError: ``max_new_tokens < 0``, ``temperature <= 0`` or ``top_k < 1``.

        Examples:
            >>> import torch
            >>> from gna_lens.testing import tiny_hooked_ssm
            >>> model = tiny_hooked_ssm("mamba2")
            >>> out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
            >>> out.shape
            torch.Size([1, 7])
        """
        if max_new_tokens < 0 or temperature <= 0 or (top_k is not None and top_k < 1):
            raise ConfigError(
                f"generate(max_new_tokens={max_new_tokens}, temperature={temperature}, "
                f"top_k={top_k}); expected max_new_tokens >= 0, temperature > 0 and top_k >= 1 "
                "or None."
            )
        is_text = not isinstance(input, Tensor)
        tokens, mask = self._tokens_and_mask(input, padding_side="left")  # ignored for ids
        device = self.embed.weight.device
        mask = torch.ones_like(tokens) if mask is None else mask.to(device)
        eos = getattr(self.tokenizer, "eos_token_id", None) if stop_at_eos else None
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        for _ in range(max_new_tokens):
            logits = self(tokens, attention_mask=mask)[:, -1].float()
            if do_sample:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            if eos is not None:
                nxt = torch.where(done, torch.full_like(nxt, int(eos)), nxt)
                done = done | (nxt == int(eos))
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if eos is not None and bool(done.all()):
                break
        if (return_type or ("str" if is_text else "tokens")) == "tokens":
            return tokens
        tok = self._require_tokenizer()
        texts = [tok.decode(row[m.bool()].tolist()) for row, m in zip(tokens, mask, strict=True)]
        return texts[0] if isinstance(input, str) else texts

    # ------------------------------------------------------------------ tokens
    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                "This HookedSSM has no tokenizer; pass token ids, or load it with a tokenizer "
                "(HookedSSM.from_pretrained(..., tokenizer=tok) or model.tokenizer = tok)."
            )
        return self.tokenizer

    def _tokens_and_mask(
        self,
        input: str | list[str] | Tensor,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if isinstance(input, Tensor):
            tokens = input if input.ndim == 2 else input[None]
            return tokens.to(self.embed.weight.device), None
        texts = [input] if isinstance(input, str) else list(input)
        tok = self._require_tokenizer()
        rows: list[list[int]] = []
        for text in texts:
            ids = list(tok(text, add_special_tokens=prepend_bos is not False)["input_ids"])
            bos = tok.bos_token_id
            if prepend_bos and bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            rows.append(ids)
        width = max(len(r) for r in rows)
        side = padding_side or getattr(tok, "padding_side", "right")
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        padded = torch.full((len(rows), width), pad, dtype=torch.long, device=HOST)
        mask = torch.zeros_like(padded)
        for i, r in enumerate(rows):
            cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            padded[i, cols], mask[i, cols] = torch.tensor(r, device=HOST), 1
        device = self.embed.weight.device
        return padded.to(device), mask.to(device)

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize text into ``[batch, pos]`` ids (padded on ``padding_side`` for lists).

        Args:
            input: A text or a list of texts.
            prepend_bos: Prepend BOS (default: the tokenizer's behaviour).
            padding_side: ``"left"`` or ``"right"`` for lists of texts.
            move_to_device: Accepted for TransformerLens compatibility (always on the model's
                device).
            truncate: Accepted for TransformerLens compatibility (SSMs have no context limit).

        Returns:
            Token ids.
        """
        del move_to_device, truncate
        return self._tokens_and_mask(input, prepend_bos, padding_side)[0]

    def to_str_tokens(self, input: str | Tensor, prepend_bos: bool | None = None) -> list[str]:
        """Split text (or a 1-D / ``[1, pos]`` token tensor) into its token strings."""
        tok = self._require_tokenizer()
        ids = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else input
        flat = ids.reshape(-1).tolist()
        return [tok.decode([i]) for i in flat]

    def to_string(self, tokens: Tensor | list[int]) -> str | list[str]:
        """Decode token ids (``[pos]`` or ``[batch, pos]``) back to text."""
        tok = self._require_tokenizer()
        t = torch.as_tensor(tokens, device=HOST)
        if t.ndim == 2:
            return [tok.decode(row.tolist()) for row in t]
        return cast("str | list[str]", tok.decode(t.tolist()))

    def to_single_token(self, string: str) -> int:
        """The id of ``string``, which must be exactly one token."""
        ids = self.to_tokens(string, prepend_bos=False)[0].tolist()
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens ({ids}); expected exactly one.")
        return int(ids[0])


def _lm_loss(logits: Tensor, tokens: Tensor, mask: Tensor | None, per_token: bool) -> Tensor:
    logprobs = logits[:, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    if per_token:
        return nll
    if mask is None:
        return nll.mean()
    valid = (mask[:, 1:] * mask[:, :-1]).to(nll.dtype)
    return (nll * valid).sum() / valid.sum().clamp(min=1)
