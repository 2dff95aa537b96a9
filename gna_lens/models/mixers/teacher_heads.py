"""A Mamba-2-style mixer some of whose heads are its Transformer teacher's attention heads again
(:func:`gna_lens.hybrid.swap_teacher_heads`).

Every head keeps its number, which is the teacher's head number (a distilled student such as
Llamba has the teacher's heads: ``n_heads`` heads of the teacher's ``head_dim``). An SSM head
computes exactly what it computed in the student (the layer's ``in_proj``, convolution, scan,
``D`` skip and gate). A swapped head ``h`` is the teacher's attention head ``h`` of that layer,
its weights copied:

    q = RoPE(q_proj(u))    the teacher's query rows of head h           [pos, d_head]
    k = RoPE(k_proj(u))    the rows of the KV head h reads (GQA)        [pos, d_head]
    v = v_proj(u)          the same KV head's value rows                [pos, d_head]
    z_h = softmax(q k^T / sqrt(d_head), causal) v                       (hook_z's slice)

where ``u`` is the layer's normed input. ``z_h`` goes into ``hook_z`` in place of the SSM
head's gated output (no gate, no ``D``) and reaches the residual stream through the teacher's
``o_proj`` columns of head ``h``, which replace the student's ``out_proj`` columns of that head
(the layer's output bias, which belongs to no head, stays the student's). The student's SSM
computation of a swapped head still runs (its ``hook_ssm_*`` slices hold it) because Mamba-2's
gated RMSNorm normalizes groups of heads together: keeping it in the norm keeps the other heads
of its group exact; its result is not used otherwise.

The new parameters are ``q_proj`` (a row block per swapped head), ``k_proj`` / ``v_proj`` (a
row block per KV head the swapped heads read). ``hook_pattern`` holds every head's matrix: the
SSM heads' ``M`` and the swapped heads' softmax pattern; an edit changes the output of both
(``z_h = P_h @ v_h`` for a swapped head).

The class is built per student mixer class (:func:`teacher_heads_class`): the SSM heads run the
student's own code (Mamba-2's, Llamba's DiscreteMamba2, ...), the swapped heads this module's.
"""

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from jaxtyping import Float
from torch import Tensor, nn

from gna_lens.errors import ConfigError
from gna_lens.models import kernels
from gna_lens.models.mixers.attention import AttentionHeads, Rope, allowed_keys
from gna_lens.models.mixers.base import (
    StepState,
    has_hooks,
    masked,
    scatter_rows_heads,
)
from gna_lens.models.mixers.mamba2 import Mamba2Mixer
from gna_lens.models.mixers.swapped import mixed_pattern_output

__all__ = ["TeacherHeadsMixer", "teacher_heads_class"]


class TeacherHeadsMixer(AttentionHeads, Mamba2Mixer):
    """A Mamba-2-style layer with some heads replaced by the teacher's attention heads (module
    docstring). Made by :meth:`from_mixer`, never by its constructor.

    Hook points beyond the student mixer's (``attn_head`` indexes :attr:`attn_heads`,
    ``kv_head`` :attr:`kv_heads`): ``hook_q`` / ``hook_rot_q`` ``[batch, pos, attn_head,
    d_head]``, ``hook_k`` / ``hook_rot_k`` / ``hook_v`` ``[batch, pos, kv_head, d_head]``,
    ``hook_attn_scores`` ``[batch, attn_head, query_pos, key_pos]``. ``hook_pattern`` and
    ``hook_z`` hold every head (the swapped heads' softmax pattern and attention output);
    ``hook_ssm_*`` hold every head's SSM computation (a swapped head's is unused but for the
    gated norm).

    Attributes:
        attn_heads: The swapped heads (sorted).
        kv_heads: The teacher KV heads they read (sorted).
    """

    uses_rope: ClassVar[bool] = True
    unsaved_reason: ClassVar[str | None] = (
        "it has teacher heads in Mamba-2-style layers (swap_teacher_heads), which no checkpoint "
        "format holds. Fix: keep the student and the teacher and call swap_teacher_heads again "
        "after loading (it is deterministic); a hybrid student of build_hybrid with swapped "
        "heads saves"
    )
    prefix_hooks: ClassVar[tuple[str, ...]] = (*Mamba2Mixer.prefix_hooks, "hook_rot_k", "hook_v")

    attn_heads: list[int]
    kv_heads: list[int]
    scale: float

    def __init__(self, *args: Any, **kwargs: Any):
        raise ConfigError(
            "TeacherHeadsMixer is made from a student's mixer: "
            "TeacherHeadsMixer.from_mixer(mixer, heads, teacher_attention_weights), or "
            "gna_lens.hybrid.swap_teacher_heads(student, teacher, heads) for a whole model."
        )

    @classmethod
    def from_mixer(
        cls, mixer: Mamba2Mixer, heads: Sequence[int], weights: Mapping[str, Tensor]
    ) -> "TeacherHeadsMixer":
        """A copy of ``mixer`` (its weights exactly, sharing its config) whose ``heads`` are
        the teacher's attention heads with the teacher's weights.

        The config must hold the teacher's attention fields (``n_attn_kv_heads``, ``attn_bias``,
        ``rotary_dim``, ``rope_theta``, ``rope_scaling``, ``attn_scale``):
        :func:`~gna_lens.hybrid.swap_teacher_heads` sets them.

        Args:
            mixer: A Mamba-2-style mixer whose heads are the teacher's (``n_heads`` heads of the
                teacher's ``head_dim``, ``d_inner = n_heads * d_head``); it is not modified.
            heads: The heads to swap (each of ``0 .. n_heads - 1``).
            weights: The teacher layer's attention weights under Hugging Face Llama names
                without their prefix: ``q_proj.weight`` ``[n_heads * d_head, d_model]``,
                ``k_proj.weight``, ``v_proj.weight`` ``[n_kv_heads * d_head, d_model]``,
                ``o_proj.weight`` ``[d_model, n_heads * d_head]`` and the ``.bias`` of the first
                three when the teacher has attention biases.

        Returns:
            The new mixer, on ``mixer``'s device and dtype.

        Raises:
            ConfigError: For a mixer that is not a plain Mamba-2-style mixer, whose heads do not
                line up with ``d_inner``, or heads out of range.
        """
        if not isinstance(mixer, Mamba2Mixer) or mixer.head_kinds is not None:
            raise ConfigError(
                f"TeacherHeadsMixer.from_mixer(mixer={type(mixer).__name__}); expected a "
                "Mamba-2-style mixer whose heads are all SSM heads (Mamba2Mixer, "
                "DiscreteMamba2Mixer, ...)."
            )
        cfg = mixer.cfg
        H, P, KV = cfg.n_heads, cfg.d_head, cfg.n_attn_kv_heads
        if cfg.d_inner != H * P or KV < 1 or H % KV:
            raise ConfigError(
                f"TeacherHeadsMixer.from_mixer: n_heads={H} heads of d_head={P} over "
                f"d_inner={cfg.d_inner} with n_attn_kv_heads={KV}; expected n_heads * d_head == "
                "d_inner and KV heads dividing the heads."
            )
        chosen = sorted({int(h) for h in heads})
        bad = [h for h in chosen if not 0 <= h < H]
        if bad or not chosen:
            raise ConfigError(
                f"TeacherHeadsMixer.from_mixer(heads={list(heads)!r}); expected at least one "
                f"head of 0..{H - 1}."
            )
        new: Any = copy.deepcopy(mixer, memo={id(cfg): cfg})
        new.__class__ = teacher_heads_class(type(mixer))
        new._add_teacher_heads(chosen, weights)
        return cast("TeacherHeadsMixer", new)

    def _add_teacher_heads(self, heads: list[int], weights: Mapping[str, Tensor]) -> None:
        cfg = self.cfg
        H, d, D = cfg.n_heads, cfg.d_head, cfg.d_model
        per_kv = H // cfg.n_attn_kv_heads
        self.attn_heads = heads
        self.kv_heads = sorted({h // per_kv for h in heads})
        self.scale = float(cfg.attn_scale or d**-0.5)
        first = self.out_proj.weight
        device, dtype = first.device, first.dtype
        bias = bool(cfg.attn_bias)
        n_kv = len(self.kv_heads)
        self.q_proj = nn.Linear(D, len(heads) * d, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(D, n_kv * d, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(D, n_kv * d, bias=bias, device=device, dtype=dtype)

        def rows(name: str, blocks: list[int]) -> dict[str, Tensor]:
            out = {}
            for p in ("weight", "bias") if bias else ("weight",):
                w = weights[f"{name}.{p}"]
                out[p] = torch.cat([w[i * d : (i + 1) * d] for i in blocks])
            return out

        with torch.no_grad():
            self.q_proj.load_state_dict(rows("q_proj", heads))
            self.k_proj.load_state_dict(rows("k_proj", self.kv_heads))
            self.v_proj.load_state_dict(rows("v_proj", self.kv_heads))
            o_proj = weights["o_proj.weight"].to(device=device, dtype=dtype)
            for h in heads:
                self.out_proj.weight[:, h * d : (h + 1) * d] = o_proj[:, h * d : (h + 1) * d]
        kv_of = [self.kv_heads.index(h // per_kv) for h in heads]
        for name, values in (("attn_index", heads), ("attn_kv", kv_of)):
            index = torch.tensor(values, dtype=torch.long, device=device)
            self.register_buffer(name, index, persistent=False)
        self._add_attention_hooks()

    # ------------------------------------------------------------------ forward
    def forward(
        self, h: Float[Tensor, "batch pos d_model"], mask: Tensor | None, rope: Rope = None
    ) -> Float[Tensor, "batch pos d_model"]:
        z, x, B, C, dt, A = self._sequence_inputs(h, mask)
        h = masked(h, mask)
        q, k, v = self._qkv(h, rope)
        materialize = has_hooks(self.hook_pattern)
        if not materialize and not has_hooks(self.hook_attn_scores):
            y_attn = self._fused_attention(q, k, v, mask)
            return self._output(self._scan(x, dt, A, B, C), x, z, h.dtype, y_attn)
        P_attn = self._attend(q, k, allowed_keys(h.shape[1], mask, h.device))
        v_heads = self._per_head(v)
        if not materialize:
            y_attn = torch.einsum("bhqk,bkhd->bqhd", P_attn, v_heads)
            return self._output(self._scan(x, dt, A, B, C), x, z, h.dtype, y_attn)
        y, y_attn = self._scan_materialized(x, dt, A, B, C, P_attn, v_heads)
        return self._output(y, x, z, h.dtype, y_attn)

    def _scan_materialized(
        self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, P_attn: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """With ``hook_pattern`` hooked: every selected head's matrix through it (SSM heads' ``M``,
        swapped heads' softmax), and the output read off the returned matrix.

        Returns:
            ``(y, y_attn)``: every head's SSM output ``[b, L, H, P]`` (a swapped head's: its SSM
            computation, for the gated norm) and the swapped heads' attention output
            ``[b, L, attn_head, d_head]``.
        """
        heads, rows = self._selection(x.shape[1], x.device)
        index: Tensor = self.attn_index  # type: ignore[assignment]
        # every head's scan: the heads and rows the pattern leaves out, and the swapped heads'
        # SSM output, which the gated norm reads (through hook_ssm_state when it is hooked)
        y = self._scanned(x, dt, A, B, C, True, heads, rows)
        if y is None:
            y, path = kernels.mamba2_scan(self.scan_values(x, dt), dt, A, B, C, self.cfg.chunk_size)
            self._record_scan(f"materialized+{path}")
        self._check_dtype(x.dtype)
        y_sel = mixed_pattern_output(self, dt, A, B, C, P_attn, x, v, heads, rows)
        # every head's output (swapped heads: attention), the pattern's heads and rows read off it
        y_attn_all = torch.einsum("bhqk,bkhp->bqhp", P_attn.to(v.dtype), v)
        both = y.index_copy(2, index, y_attn_all.to(y.dtype))
        both = scatter_rows_heads(both, y_sel, heads, rows, head_dim=2)
        return both.index_copy(2, index, y.index_select(2, index)), both.index_select(2, index)

    # ------------------------------------------------------------------ incremental
    def prefix_state(self, acts: Mapping[str, Tensor], length: int) -> StepState:
        """The student mixer's state (convolution window, SSM state of every head), plus the
        swapped heads' rotated keys and values of the first ``length`` positions
        (``"attn_k"``, ``"attn_v"``: ``[G, length, kv_head, d_head]``)."""
        out = super().prefix_state(acts, length)
        out["attn_k"], out["attn_v"] = acts["hook_rot_k"][:, :length], acts["hook_v"][:, :length]
        return out

    def step(  # type: ignore[override]
        self, state: StepState, h: Float[Tensor, "batch 1 d_model"], rope: Rope = None
    ) -> Tensor:
        """One token after the prefix (``rope``: its position's rotation; see
        :meth:`SSMMixer.step`)."""
        self._refuse_step_patterns()
        z, x, y = self._step_scan(state, h)
        q, k, v = self._qkv(h, rope)
        k = torch.cat([state["attn_k"].to(k.dtype), k], dim=1)
        v = torch.cat([state["attn_v"].to(v.dtype), v], dim=1)
        y_attn = torch.einsum("bhqk,bkhd->bqhd", self._attend(q, k, None), self._per_head(v))
        return self._output(y, x, z, h.dtype, y_attn)

    def extra_repr(self) -> str:
        return f"teacher_heads={self.attn_heads}"


_CLASSES: dict[type, type] = {Mamba2Mixer: TeacherHeadsMixer}


def teacher_heads_class(base: type) -> type[TeacherHeadsMixer]:
    """The :class:`TeacherHeadsMixer` class whose SSM heads run ``base``'s code (``base`` a
    :class:`~gna_lens.models.mixers.Mamba2Mixer` subclass; one class per base, made once).

    Examples:
        >>> from gna_lens.models.mixers import DiscreteMamba2Mixer
        >>> cls = teacher_heads_class(DiscreteMamba2Mixer)
        >>> cls.__name__, issubclass(cls, DiscreteMamba2Mixer), teacher_heads_class(DiscreteMamba2Mixer) is cls
        ('TeacherHeadsDiscreteMamba2Mixer', True, True)
    """
    if issubclass(base, TeacherHeadsMixer):
        return base
    if not issubclass(base, Mamba2Mixer):
        raise ConfigError(
            f"teacher_heads_class({base.__name__}); expected a Mamba2Mixer subclass (the SSM "
            "heads run its code)."
        )
    if base not in _CLASSES:
        name = f"TeacherHeads{base.__name__}"
        cls = type(name, (TeacherHeadsMixer, base), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # importable by name (pickle)
        _CLASSES[base] = cls
    return _CLASSES[base]  # type: ignore[return-value]
