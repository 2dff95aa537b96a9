"""Distill a hybrid student from its teacher: per-layer alignment, then the teacher's logits
(:func:`distill`; the docs page "Hybrid students" describes the method).

**Speed.** Nothing on the training path hooks a pattern, so every layer runs its fast path
(:class:`~gna_lens.models.mixers.hybrid.HybridMixer`: fused attention for the attention heads,
one chunked SSD scan in the compute dtype with float32 states for the SSM heads); stage 2's
KL is computed over the vocabulary in blocks of tokens, its gradient written directly
(:func:`kl_per_token`); the loop of :mod:`gna_lens.hybrid._train` never waits for the device.
"""

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gna_lens import runtime
from gna_lens.device import HOST, to_host
from gna_lens.errors import ConfigError
from gna_lens.hybrid._budget import Budget, parse_budget
from gna_lens.hybrid._data import default_distill_data, describe_data
from gna_lens.hybrid._train import Loop, RunOutcome, Stage, StepLosses, loss_stage, run_stages
from gna_lens.models.hooked_ssm import HookedSSM
from gna_lens.models.mixers.hybrid import HybridMixer
from gna_lens.render.plotly import distill_figure
from gna_lens.runtime import PrecisionChoice, choose_precision

__all__ = [
    "SSM_PARAMS",
    "TRAIN_CHOICES",
    "DistillResult",
    "distill",
    "kl_per_token",
    "teacher_twin",
]

#: The SSM heads' parameters of a :class:`~gna_lens.models.mixers.hybrid.HybridMixer`.
SSM_PARAMS = ("c_proj", "b_proj", "x_proj", "dt_proj", "dt_bias", "A_log", "D")
#: What stage 2 may train: ``"ssm"`` (default), ``"mixers"`` or ``"all"``.
TRAIN_CHOICES = ("ssm", "mixers", "all")


class _Stop(Exception):
    """Raised by a capture hook once the last needed layer has run (skips the rest)."""


@dataclass(frozen=True)
class DistillResult:
    """What :func:`distill` did, step by step.

    Attributes:
        stages: The stages run (``(1, 2)``).
        budget: The budget of the whole run (stage 1 gets ``stage1_share`` of it).
        seed: The seed.
        records: One per step and layer (stage 1) or per step (stage 2): ``stage``, ``step``,
            ``layer`` (stage 1; ``None`` in stage 2), ``loss`` (normalized squared error in
            stage 1, KL in nats per token in stage 2), ``tokens`` and ``seconds`` so far in the
            stage, ``lr``, ``trained``.
        probe: Per stage, its loss on the probe batch (the data's first batch) ``"before"`` and
            ``"after"`` the stage.
        totals: Per stage, ``tokens``, ``seconds``, ``steps``.
        trained: Per stage, what it trained, in words.
        n_trained: Per stage, how many parameters it trained.
        complete: Whether every stage ran to its budget (``False`` after ``max_steps`` stopped
            the call: resume with the same ``checkpoint_dir``).
        resumed_at: Where a resumed run picked up (stage index, step, texts read), else ``None``.
        method: The settings, data, teacher and student, JSON-ready.
    """

    stages: tuple[int, ...]
    budget: Budget
    seed: int
    records: tuple[dict[str, Any], ...]
    probe: dict[str, dict[str, float]]
    totals: dict[str, dict[str, float]]
    trained: dict[str, str]
    n_trained: dict[str, int]
    complete: bool
    resumed_at: dict[str, Any] | None = None
    method: dict[str, Any] = field(default_factory=dict)

    def to_dataframe(self) -> Any:
        """The records, one row each (see :attr:`records`)."""
        import pandas as pd

        cols = ["stage", "step", "layer", "loss", "tokens", "seconds", "lr", "trained"]
        return pd.DataFrame(list(self.records), columns=cols)

    def loss_change(self, stage: str) -> tuple[float, float]:
        """``(before, after)`` of ``stage`` (``"stage1"``, ``"stage2"``) on the probe batch."""
        p = self.probe.get(stage, {})
        return float(p.get("before", math.nan)), float(p.get("after", math.nan))

    def figure(self) -> Any:
        """A plotly figure: each stage's loss (mean over layers in stage 1) against tokens."""
        return distill_figure(self)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the per-step records, JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "records"}
        return out | {"stages": list(self.stages), "budget": self.budget.to_dict()}


def _result(
    outcome: RunOutcome,
    stages: tuple[int, ...],
    budget: Budget,
    seed: int,
    trained: dict[str, str],
    n_trained: dict[str, int],
    method: dict[str, Any],
) -> DistillResult:
    """The :class:`DistillResult` of a :func:`~gna_lens.hybrid._train.run_stages` run."""  # fmt: skip
    state = outcome.state
    return DistillResult(
        stages, budget, seed, tuple(state.records), dict(state.probe), dict(state.totals),
        trained, n_trained, state.complete, outcome.resumed_at, method,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the teacher
def teacher_twin(teacher: Any, like: HookedSSM | None = None) -> HookedSSM:
    """The teacher as a HookedSSM that keeps every head as attention (its logits to 1e-4).

    Args:
        teacher: What :func:`~gna_lens.hybrid.build_hybrid` accepts, or such a twin already
            built (returned as is).
        like: A student whose dtype and device the twin takes.
    """
    from gna_lens.hybrid._build import build_hybrid, check_twin, hf_model

    if isinstance(teacher, HookedSSM):
        check_twin(teacher, "distill")
        return teacher
    dtype = device = None
    if like is not None:
        first = next(iter(like.parameters()))
        dtype, device = first.dtype, first.device
    config = hf_model(teacher, "distill")[0].config
    heads = range(int(config.num_attention_heads))
    every = [(layer, h) for layer in range(int(config.num_hidden_layers)) for h in heads]
    return build_hybrid(teacher, every, dtype=dtype, device=device)


def _check_pair(student: Any, twin: HookedSSM) -> None:
    if not isinstance(student, HookedSSM) or student.cfg.architecture != "gna_hybrid":
        got = type(student).__name__
        arch = getattr(getattr(student, "cfg", None), "architecture", "?")
        raise ConfigError(
            f"distill(student={got} ({arch})): the student must be a hybrid student of "
            "gna_lens.hybrid.build_hybrid (a HookedSSM of architecture 'gna_hybrid'); for SSM "
            "heads of another model use swap_heads."
        )
    a, b = student.cfg, twin.cfg
    mine = (a.n_layers, a.n_heads, a.d_head, a.d_model, a.d_vocab)
    theirs = (b.n_layers, b.n_heads, b.d_head, b.d_model, b.d_vocab)
    if mine != theirs:
        raise ConfigError(
            f"distill: the student (layers, heads, d_head, d_model, vocab) = {mine} does not match "
            f"the teacher's {theirs}; pass the teacher the student was built from."
        )


# ----------------------------------------------------------------------------- losses
def _mixer(model: HookedSSM, layer: int) -> Any:
    block: Any = model.blocks[layer]
    return block.mixer


def _capture(
    twin: HookedSSM, ids: Tensor, layers: list[int]
) -> tuple[dict[int, tuple[Tensor, Any]], dict[int, Tensor]]:
    """Per layer, the teacher's normed input to the attention (with RoPE) and its output."""
    inputs: dict[int, tuple[Tensor, Any]] = {}
    outputs: dict[int, Tensor] = {}
    last = max(layers)
    handles = []

    def hook(layer: int, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        rope = args[2] if len(args) > 2 else None
        inputs[layer] = (args[0].detach(), rope)
        outputs[layer] = out.detach()
        if layer == last:
            raise _Stop

    try:
        for layer in layers:
            handles.append(_mixer(twin, layer).register_forward_hook(partial(hook, layer)))
        with torch.no_grad(), contextlib.suppress(_Stop):
            twin(ids)
    finally:
        for h in handles:
            h.remove()
    return inputs, outputs


def _nmse(out: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    m = mask[..., None].to(torch.float32)
    err = ((out.float() - target.float()) ** 2 * m).sum()
    return err / ((target.float() ** 2 * m).sum() + 1e-12)


#: Elements of a ``[tokens, vocabulary]`` block of the KL in float32 (256 MB): the tokens per
#: block are this over the vocabulary size.
KL_BLOCK = 1 << 26


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """``logits`` in float32 over ``temperature`` (no division at 1: the same numbers)."""
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


class _BlockedKL(torch.autograd.Function):
    """:func:`kl_per_token` per row, in blocks of rows; the backward pass writes
    ``(softmax(s / T) - softmax(t / T)) / T`` times the row's incoming gradient, per block."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, s_logits: Tensor, t_logits: Tensor, temperature: float, rows: int
    ) -> Tensor:
        n = s_logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=s_logits.device)
        for i in range(0, n, rows):
            s = F.log_softmax(_scaled(s_logits[i : i + rows], temperature), dim=-1)
            t = F.log_softmax(_scaled(t_logits[i : i + rows], temperature), dim=-1)
            out[i : i + rows] = (t.exp() * (t - s)).sum(-1)
        ctx.save_for_backward(s_logits, t_logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        s_logits, t_logits = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        out = torch.empty_like(s_logits)
        for i in range(0, s_logits.shape[0], rows):
            s = torch.softmax(_scaled(s_logits[i : i + rows], T), dim=-1)
            t = torch.softmax(_scaled(t_logits[i : i + rows], T), dim=-1)
            out[i : i + rows] = (s.sub_(t).mul_(grad[i : i + rows, None] / T)).to(out.dtype)
        return out, None, None, None


def kl_per_token(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """``KL(teacher || student)`` of each token's next-token distribution at ``temperature``.

    Computed in float32 over blocks of tokens (:data:`KL_BLOCK` elements each), its gradient
    with respect to ``student_logits`` written directly, so neither pass keeps a float32 copy
    of the ``[tokens, vocabulary]`` logits (at a 128k vocabulary and 16 x 512 tokens, each
    such copy is 4.2 GB).

    Args:
        student_logits: ``[..., vocabulary]`` (gradients flow to it).
        teacher_logits: The same shape (no gradient).
        temperature: Divides both logits before the softmax.

    Returns:
        ``[...]``, float32, in nats.

    Examples:
        >>> import torch
        >>> s = torch.tensor([[0.0, 1.0], [2.0, 0.0]], device="cpu")
        >>> kl_per_token(s, s.flip(-1), 1.0)
        tensor([0.4621, 1.5232])
    """
    shape = student_logits.shape
    vocab = shape[-1]
    rows = max(1, KL_BLOCK // max(1, vocab))
    s = student_logits.reshape(-1, vocab)
    t = teacher_logits.detach().reshape(-1, vocab)
    kl: Tensor = _BlockedKL.apply(s, t, float(temperature), rows)
    return kl.reshape(shape[:-1])


def _kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, temperature: float) -> Tensor:
    """``KL(teacher || student)`` per token at ``temperature``, mean over ``mask``'s tokens."""
    kl = kl_per_token(student_logits, teacher_logits, temperature)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp(min=1)


# ----------------------------------------------------------------------------- parameters
def _ssm_layers(student: HookedSSM) -> list[int]:
    return [
        i
        for i, b in enumerate(student.blocks)
        if isinstance(getattr(b, "mixer", None), HybridMixer) and _mixer(student, i).ssm_heads
    ]


def _layer_params(
    model: HookedSSM, layer: int, names: tuple[str, ...] = SSM_PARAMS
) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``names`` of layer ``layer``'s mixer, with their names in ``model``."""
    return [
        (f"blocks.{layer}.mixer.{name}", p)
        for name, p in _mixer(model, layer).named_parameters()
        if name.split(".")[0] in names
    ]


def _stage2_params(student: HookedSSM, train: Any) -> tuple[list[tuple[str, nn.Parameter]], str]:
    named = list(student.named_parameters())  # tied weights appear once
    if train == "ssm":
        picked = [np for layer in _ssm_layers(student) for np in _layer_params(student, layer)]
        what = f"SSM heads of {len(_ssm_layers(student))} layers"
    elif train == "mixers":
        picked = [(n, p) for n, p in named if ".mixer." in n]
        what = "every mixer (SSM and attention heads, output projections)"
    elif train == "all":
        picked, what = named, "every parameter"
    elif callable(train):
        picked = [(n, p) for n, p in named if train(n)]
        what = "parameters chosen by train=callable"
    elif isinstance(train, Iterable) and not isinstance(train, str | bytes):
        wanted = list(train)
        known = dict(named)
        bad = [n for n in wanted if n not in known]
        if bad:
            raise ConfigError(
                f"distill(train=[...]): {bad[:3]} are not parameter names of the student (e.g. "
                f"{list(known)[:2]})."
            )
        picked = [(n, known[n]) for n in dict.fromkeys(wanted)]
        what = f"{len(picked)} named parameters"
    else:
        raise ConfigError(
            f"distill(train={train!r}); expected one of {list(TRAIN_CHOICES)}, a list of "
            "parameter names or a callable name -> bool."
        )
    if not picked:
        raise ConfigError(
            f"distill(train={train!r}): nothing to train (a student keeping every head has no "
            "SSM heads); pass train='mixers' or 'all', or stages=(1,) is pointless too."
        )
    return picked, what


def _lrs(lr: Any) -> tuple[float, float]:
    if isinstance(lr, int | float) and not isinstance(lr, bool):
        vals = (float(lr), float(lr))
    elif isinstance(lr, Sequence) and len(lr) == 2:
        vals = (float(lr[0]), float(lr[1]))
    else:
        raise ConfigError(f"distill(lr={lr!r}); expected a float or (stage 1 lr, stage 2 lr).")
    if not all(v > 0 and math.isfinite(v) for v in vals):
        raise ConfigError(f"distill(lr={lr!r}); learning rates must be positive.")
    return vals


def _autocast_dtype(value: Any) -> torch.dtype | None:
    if value is None or value in ("none", "float32", torch.float32):
        return None
    if value in ("bfloat16", torch.bfloat16):
        return torch.bfloat16
    raise ConfigError(
        f"distill(autocast={value!r}); expected None, 'bfloat16' (mixed precision of the "
        "forward and backward passes; weights and optimizer stay float32) or 'auto' (bfloat16 "
        "only where a training step is measured faster and its loss stays within 2%)."
    )


@dataclass(frozen=True)
class _Plan:
    """A checked :func:`distill` call: the pair, the whole budget and how each step runs."""

    student: HookedSSM
    twin: HookedSSM
    stages: tuple[int, ...]
    budget: Budget
    stage1_share: float
    lrs: tuple[float, float]
    temperature: float
    grad_clip: float
    amp: torch.dtype | None
    device: torch.device

    def ctx(self) -> Any:
        return runtime.autocast(self.device, self.amp)

    def budget_of(self, stage: int) -> Budget:
        """Stage ``stage``'s share of the budget (all of it when it runs alone)."""
        if len(self.stages) == 1:
            return self.budget
        return self.budget.share(self.stage1_share if stage == 1 else 1 - self.stage1_share)


def _choose_autocast(plan: _Plan, batch_size: int, max_length: int, seed: int) -> PrecisionChoice:
    """``distill(autocast="auto")``: one stage-2 training step on random tokens timed in float32
    and under bfloat16 autocast (:func:`gna_lens.runtime.choose_precision`); bfloat16 where it is
    faster and moves the KL by at most 2% (+ 0.01 nats). No trace: gradients cleared, the tokens
    from a generator of their own, the weights not stepped."""
    student, device, loss = plan.student, plan.device, _stage2_loss(plan)  # plan.amp is None
    gen = torch.Generator().manual_seed(seed)
    vocab = int(student.cfg.d_vocab)
    ids = torch.randint(vocab, (batch_size, max_length), generator=gen, device=HOST).to(device)
    mask = torch.ones(batch_size, max_length, dtype=torch.bool, device=device)

    def loss_in(bf16: bool) -> float:
        with torch.no_grad(), runtime.autocast(device, "bfloat16" if bf16 else None):
            return float(loss(ids, mask))

    def check() -> tuple[bool, str]:
        ref, low = loss_in(False), loss_in(True)
        ok = abs(low - ref) <= 0.02 * abs(ref) + 0.01
        return ok, (
            f"stage-2 KL on the probe batch {low:.4f} under bfloat16 vs {ref:.4f} in float32 "
            "(allowed 2% + 0.01)"
        )

    try:
        return choose_precision(
            "auto", run=lambda: loss(ids, mask).backward(), device=device,
            what=f"one training step on {batch_size} x {max_length} tokens",
            weights_dtype=next(iter(student.parameters())).dtype, check=check,
            where="distill(autocast)",
        )  # fmt: skip
    finally:
        student.zero_grad(set_to_none=True)


def _stage1(plan: _Plan) -> Stage:
    """Stage 1: each layer's SSM heads trained alone toward the teacher's attention output."""
    student, twin, layers = plan.student, plan.twin, _ssm_layers(plan.student)
    if not layers:
        raise ConfigError(
            "distill(stages=(1, ...)): the student has no SSM heads (every head was kept), "
            "so there is nothing to align; use stages=(2,) with train='mixers' or 'all'."
        )
    per_layer = {layer: _layer_params(student, layer) for layer in layers}

    def layer_loss(ids: Tensor, mask: Tensor) -> Iterator[tuple[int, Tensor]]:
        with plan.ctx():
            inputs, targets = _capture(twin, ids, layers)
        for layer in layers:  # each alone: one layer's activations alive at a time
            h, rope = inputs[layer]
            with plan.ctx():
                y = _mixer(student, layer)(h, None, rope)
            yield layer, _nmse(y, targets[layer], mask)

    def step(ids: Tensor, mask: Tensor) -> StepLosses:
        out: StepLosses = []
        for layer, loss in layer_loss(ids, mask):
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in per_layer[layer]], plan.grad_clip)
            out.append((layer, loss.detach()))  # read back at the next logging point
        return out

    def probe(ids: Tensor, mask: Tensor) -> float:
        with torch.no_grad():
            losses = to_host(torch.stack([loss for _, loss in layer_loss(ids, mask)])).tolist()
        return float(sum(losses) / len(losses))  # one synchronization

    params = [np for layer in layers for np in per_layer[layer]]
    word = f"SSM heads of layers {layers[0]}-{layers[-1]}, each alone"
    return Stage("stage1", params, step, probe, plan.budget_of(1), plan.lrs[0], word)


def _stage2_loss(plan: _Plan) -> Callable[[Tensor, Tensor], Tensor]:
    """Stage 2's loss: ``KL(teacher || student)`` of the next-token distributions."""

    def loss(ids: Tensor, mask: Tensor) -> Tensor:
        with torch.no_grad(), plan.ctx():
            t_logits = plan.twin(ids)
        with plan.ctx():
            s_logits = plan.student(ids)
        return _kl(s_logits, t_logits, mask, plan.temperature)

    return loss


def _stage2(plan: _Plan, train: Any) -> Stage:
    """Stage 2: the student's next-token distributions trained toward the teacher's."""
    params, word = _stage2_params(plan.student, train)
    budget, lr = plan.budget_of(2), plan.lrs[1]
    return loss_stage("stage2", params, _stage2_loss(plan), budget, lr, word, plan.grad_clip)


# ----------------------------------------------------------------------------- distill
def distill(
    student: HookedSSM,
    teacher: Any,
    data: Iterable[str] | None = None,
    *,
    stages: Sequence[int] = (1, 2),
    budget: Any = "200k tokens",
    seed: int = 0,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    stage1_share: float = 0.25,
    train: Any = "ssm",
    lr: float | tuple[float, float] = (1e-2, 1e-3),
    batch_size: int = 8,
    max_length: int = 256,
    warmup: int = 10,
    temperature: float = 1.0,
    grad_clip: float = 1.0,
    checkpoint_every: int = 50,
    max_steps: int | None = None,
    autocast: Any = None,
    divergence_factor: float | None = 10.0,
) -> DistillResult:
    """Distill ``student`` (trained in place) from ``teacher``: stage 1, then stage 2.

    **Stage 1** (MOHAWK's hidden-state alignment, per layer): the teacher runs on a batch, and
    each student layer with SSM heads runs its own mixer on the teacher's normed input to that
    layer's attention and is trained toward the attention's output (normalized squared error
    ``sum ||y_student - y_teacher||^2 / sum ||y_teacher||^2`` over the batch's tokens). Each
    layer trains alone (its input is the teacher's), so one teacher forward serves all of
    them; only the layer's SSM-head parameters (:data:`SSM_PARAMS`) train. **Stage 2**: the
    student's next-token distributions trained toward the teacher's, ``KL(teacher ||
    student)`` at ``temperature`` (mean over tokens). The teacher runs as its twin
    (:func:`teacher_twin`), so its hooks and the student's are the same kind.

    The texts are read in order from ``data``, batched ``batch_size`` at a time (cut to
    ``max_length`` tokens, right-padded, the loss on real tokens only) as one stream for the
    whole run; the first batch is also the probe batch each stage's loss is measured on before
    and after it.

    Args:
        student: A student of :func:`~gna_lens.hybrid.build_hybrid` (its weights change).
        teacher: The teacher it was built from (TransformerBridge, Hugging Face model, folder)
            or its twin ``build_hybrid(teacher, every head)``.
        data: Any iterable of texts (a list, or :func:`default_distill_data`; a generator
            works, and a resumed run needs it to give the same texts again). ``None``:
            ``default_distill_data(student.tokenizer, seed)``.
        stages: ``(1, 2)``, ``(1,)`` or ``(2,)``.
        budget: Tokens read or wall time for the whole run (:func:`parse_budget`: ``200000``,
            ``"2M tokens"``, ``"20 min"``; see :class:`Budget`).
        seed: Seed of the default data and of torch's generator.
        checkpoint_dir: Where to keep checkpoints (:mod:`gna_lens.hybrid._train`); ``None``: none.
        resume: Pick up the run saved in ``checkpoint_dir`` (the same arguments, else a
            ConfigError says what differs); a finished run is loaded, not rerun. ``False``:
            start over there.
        progress: Show progress bars.
        stage1_share: Share of the budget for stage 1 when both stages run.
        train: What stage 2 trains: ``"ssm"`` (the SSM heads' parameters, default),
            ``"mixers"`` (every mixer parameter), ``"all"``, a list of parameter names or a
            callable ``name -> bool``.
        lr: Peak learning rate, or ``(stage 1, stage 2)``. The defaults come from short
            sweeps on SmolLM2-135M (d_state 16, batches of 8 x 128 tokens): stage 1 at 1e-2
            reached a held-out alignment loss 2-4x lower after 60 steps than at 1e-3 (3e-2
            spiked), stage 2 at 1e-3 a held-out KL of 1.08 nats after 25 steps, against 1.29 at 3e-4 and
            1.01 at 3e-3 (kept at 1e-3 for longer runs).
        batch_size: Texts per step.
        max_length: Tokens per text at most.
        warmup: Steps of linear warm-up of each stage's learning rate.
        temperature: Temperature of stage 2's distributions.
        grad_clip: Gradient norm clip (per layer in stage 1).
        checkpoint_every: Steps between checkpoints.
        max_steps: Stop this call after so many steps (the run stays resumable; the result
            says ``complete=False``).
        autocast: ``None`` (the student's dtype), ``"bfloat16"``: the teacher's and the
            student's forward and backward passes under ``torch.autocast`` in bfloat16 (the
            weights, optimizer and losses stay float32; the SSM scans' within-chunk products
            run in bfloat16, their decays and states in float32), or
            ``"auto"``: bfloat16 only where one training step is measured faster on this
            device and shape and passes an accuracy check (the result's
            ``method["autocast_choice"]`` says what was measured; speed-ups measured: the docs
            page "Hybrid students").
        divergence_factor: Stop a stage (:class:`~gna_lens.errors.DistillationDiverged`)
            whose loss is not finite, or whose mean loss over its last 5 steps, or whose loss on
            the probe batch after it, is above this many times its loss on the probe batch
            before it (at least 0.01); checked every 10 steps, at checkpoints and at each
            stage's end. ``None``: no check.

    Returns:
        A :class:`DistillResult`.

    Raises:
        ConfigError: For a student that is not a hybrid student, a teacher it was not built
            from, a bad budget (the message repeats it), bad stages, or a checkpoint of other
            settings.
        DistillationDiverged: For a stage whose loss rose above ``divergence_factor`` times
            its start or stopped being finite (the message names the stage, the step, both
            losses and the fix).

    Examples:
        >>> import tempfile
        >>> from transformer_lens.model_bridge import TransformerBridge
        >>> from gna_lens.hybrid import build_hybrid
        >>> from gna_lens.testing import tiny_checkpoint
        >>> teacher = TransformerBridge.boot_transformers(str(tiny_checkpoint("llama", tempfile.mkdtemp())))
        >>> student = build_hybrid(teacher, [(1, 2)], d_state=8)
        >>> texts = ["a b c d e f g h i j"] * 64
        >>> result = distill(student, teacher, texts, budget=600, progress=False, batch_size=4)
        >>> before, after = result.loss_change("stage2")
        >>> after < before, sorted(result.totals)
        (True, ['stage1', 'stage2'])
    """
    loop = Loop(
        "distill", batch_size, max_length, warmup, checkpoint_dir, resume, progress, max_steps,
        checkpoint_every, divergence_factor,
    )  # fmt: skip
    twin = teacher_twin(teacher, student)
    _check_pair(student, twin)
    picked = tuple(sorted(set(stages))) if isinstance(stages, Iterable) else ()
    if not picked or any(s not in (1, 2) for s in picked):
        raise ConfigError(f"distill(stages={stages!r}); expected (1, 2), (1,) or (2,).")
    total = parse_budget(budget)
    if not 0 < stage1_share < 1:
        raise ConfigError(f"distill(stage1_share={stage1_share!r}); expected a share in (0, 1).")
    lrs = _lrs(lr)
    if not temperature > 0:
        raise ConfigError(f"distill(temperature={temperature!r}); expected > 0.")
    tokenizer = student.tokenizer
    if tokenizer is None:
        raise ConfigError("distill: the student has no tokenizer (student.tokenizer is None).")
    device = next(iter(student.parameters())).device
    plan = _Plan(
        student, twin, picked, total, stage1_share, lrs, temperature, grad_clip, None, device
    )
    precision = None
    if autocast == "auto":  # measured in float32 (plan.amp is None)
        precision = _choose_autocast(plan, batch_size, max_length, seed)
        autocast = precision.autocast
    plan = replace(plan, amp=_autocast_dtype(autocast))
    if data is None:
        data = default_distill_data(tokenizer, seed)
    torch.manual_seed(seed)
    run = [_stage1(plan)] if 1 in plan.stages else []
    run += [_stage2(plan, train)] if 2 in plan.stages else []
    n_trained = {s.name: sum(p.numel() for _, p in s.params) for s in run}
    trained = {s.name: s.trained for s in run}
    if "stage1" in trained:
        trained["stage1"] += " (" + ", ".join(SSM_PARAMS) + ")"
    cfg = student.cfg
    settings = {
        "stages": list(plan.stages),
        "budget": plan.budget.to_dict(),
        "seed": seed,
        "stage1_share": stage1_share,
        "train": train if isinstance(train, str) else trained.get("stage2", ""),
        "lr": list(plan.lrs),
        "batch_size": batch_size,
        "max_length": max_length,
        "warmup": warmup,
        "temperature": temperature,
        "grad_clip": grad_clip,
        "autocast": None if plan.amp is None else str(plan.amp).removeprefix("torch."),
        "student": {
            "attention_heads": [list(h) for h in getattr(cfg, "attention_heads", [])],
            "d_state": cfg.d_state,
            "head_layout": getattr(cfg, "ssm_head_layout", ""),
        },
    }
    was_training = student.training
    student.eval()
    try:
        outcome = run_stages(
            student, run, data, tokenizer, loop, fingerprint=settings, device=plan.device
        )
    finally:
        student.train(was_training)
    method = settings | {
        "data": describe_data(data),
        "data_info": dict(getattr(data, "info", {}) or {}),
        "teacher": dict(getattr(cfg, "teacher", {}) or {}),
        "optimizer": "AdamW (betas 0.9, 0.98, no weight decay), linear warm-up then cosine to "
        "lr / 10 over each stage's budget",
        "stage1_loss": "normalized squared error of each layer's mixer output to the teacher's "
        "attention output, on the teacher's input",
        "stage2_loss": f"KL(teacher || student) per token at temperature {temperature}",
        "torch_threads": torch.get_num_threads(),
        "device": str(plan.device),
        "divergence_factor": divergence_factor,
    }
    if precision is not None:
        method["autocast_choice"] = precision.reason
        method["autocast_probe"] = None if precision.probe is None else precision.probe.to_dict()
    return _result(outcome, plan.stages, plan.budget, seed, trained, n_trained, method)
