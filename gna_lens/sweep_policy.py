"""How the head sweeps run: one function per decision, each returning its reason in words.

- :func:`choose_strategy`: which heads are ablated exactly (every head up to
  :data:`EXACT_ALL_MAX`; above, coarse to fine, or an exact scan on a GPU whose estimated time
  fits :data:`EXACT_BUDGET_S`; attribution with a prefilter).
- :func:`resolve_sweep_dtype`: float32 or bfloat16 autocast for the selection sweeps (timed and
  checked on the model's own prompts, never decided by flags).
- :func:`applied_head_groups`: Mamba-1 channels grouped into heads above :data:`EXACT_ALL_MAX`.

It sits below :mod:`gna_lens.scoring` (which asks it) and above the interventions it times.
"""

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from gna_lens.device import DevicePolicy
from gna_lens.errors import GnaLensError, InterventionError
from gna_lens.heads import (
    HookedModel,
    ModelLike,
    Subject,
    head_view,
    is_hooked_ssm,
    policy_of,
)
from gna_lens.runtime import choose_precision, native_bfloat16
from gna_lens.tasks import Task

__all__ = [
    "DEFAULT_CHANNEL_GROUP",
    "DEFAULT_PREFILTER",
    "DEFAULT_TOP_LAYERS",
    "EXACT_ALL_MAX",
    "EXACT_BUDGET_S",
    "PROBE_WORTH_S",
    "STRATEGIES",
    "applied_head_groups",
    "auto_head_groups",
    "check_bfloat16",
    "choose_strategy",
    "default_top_layers",
    "resolve_sweep_dtype",
    "sweep_precision",
    "time_per_row",
]


#: Models with at most this many heads get every head ablated exactly (``strategy="auto"``).
EXACT_ALL_MAX = 300


#: How :func:`score_heads` chooses the heads it ablates exactly:
#: ``"auto"`` (``"exact"`` up to :data:`EXACT_ALL_MAX` heads, else ``"coarse_to_fine"``),
#: ``"exact"`` (every head), ``"coarse_to_fine"`` (layers ranked by removal first, then every head
#: of the top layers), ``"attribution"`` (attribution patching ranks every head, the top
#: ``prefilter`` are ablated).
STRATEGIES = ("auto", "exact", "coarse_to_fine", "attribution")


#: On a CUDA device, ``strategy="auto"`` ablates every head exactly, even above
#: :data:`EXACT_ALL_MAX` heads, when :func:`choose_strategy` estimates that the task's and the
#: control's sweeps take at most this many seconds (a GPU sweeps a mamba2-1.3b's 3,072 heads in
#: about that; the estimate's basis is recorded in ``method["strategy_choice"]``).
EXACT_BUDGET_S = 120.0


#: ``sweep_dtype="auto"`` probes bfloat16 on a model of at most :data:`EXACT_ALL_MAX` heads
#: where its float32 selection sweep is estimated to take at least this many seconds (and the
#: device multiplies bfloat16 natively): the probe and the check cost a few seconds, worth it only
#: where bfloat16 can save tens (the demo's 270 SmolLM2 heads: 2.2x on a 2-core AMX Xeon).
PROBE_WORTH_S = 60.0


#: Layers whose heads a coarse-to-fine scan ablates, at most (see :func:`default_top_layers`).
DEFAULT_TOP_LAYERS = 4


#: Channels per head of the contiguous groups that ``head_groups="auto"`` makes on a Mamba-1 /
#: FalconMamba model above :data:`EXACT_ALL_MAX` single-channel heads: 64, the head width of
#: Mamba-2 (mamba-130m's 1,536 channels per layer make 24 groups, as many as mamba2-130m's heads;
#: Falcon-Mamba-7B's 8,192 make 128).
DEFAULT_CHANNEL_GROUP = 64


#: Heads ablated exactly after attribution patching when ``strategy="attribution"`` is given no
#: ``prefilter``.
DEFAULT_PREFILTER = 32


def resolve_sweep_dtype(
    model: ModelLike, sweep_dtype: Any, task: Task | None = None, n_swept: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """The sweep dtype to run (``"auto"`` resolved) and what to record about the choice.

    ``"auto"`` is :func:`gna_lens.runtime.choose_precision` on a forward pass like the sweep's
    (16 of ``task``'s prompts, last-position logits) with :func:`check_bfloat16` as the check,
    for a model of more than :data:`EXACT_ALL_MAX` heads (as grouped now), and for a smaller one
    whose float32 sweep of ``n_swept`` heads on ``task`` is estimated at
    :data:`PROBE_WORTH_S` or more on a device with native bfloat16 (the estimate is
    :func:`time_per_row`'s, as :func:`choose_strategy`'s). Other models keep float32 without
    probing. The record (``sweep_dtype_choice``, ``sweep_dtype_probe``) says what was measured.
    Other values are returned as given.

    Args:
        model: The model.
        sweep_dtype: ``"auto"``, ``None`` / ``"float32"`` or ``"bfloat16"``.
        task: The selection task (the probe's and the check's prompts); needed by ``"auto"``
            on a large model.
        n_swept: Heads the sweep ablates one by one (``None``: every head).

    Examples:
        >>> from gna_lens.testing import toy_gna_model
        >>> resolve_sweep_dtype(toy_gna_model(), "auto")
        (None, {'sweep_dtype_choice': 'auto: float32 (4 heads: a small model)'})
    """
    if sweep_dtype != "auto":
        return sweep_dtype, {}
    subject = Subject.of(model)
    n = subject.view.n_heads_total
    param = next(iter(subject.model.parameters()), None)
    if param is None:
        return None, {"sweep_dtype_choice": "auto: the model's own dtype (no parameters)"}
    large = n > EXACT_ALL_MAX
    if large and task is None and param.dtype == torch.float32:
        raise GnaLensError(
            "resolve_sweep_dtype(model, 'auto') on a large model needs task= (its prompts are "
            "what bfloat16 is timed and checked on). Fix: pass the selection task."
        )
    why_small = f"{n:,} heads: a small model"
    if large:
        why_big = f"the model is large ({n:,} heads, more than {EXACT_ALL_MAX})"
    elif task is not None and param.dtype == torch.float32 and native_bfloat16(param.device):
        est, basis = _sweep_seconds(subject, task, n if n_swept is None else n_swept, repeats=1)
        large = est >= PROBE_WORTH_S
        why_big = f"the float32 sweep is long (estimated {est:.0f} s: {basis})"
        why_small = (
            f"a short sweep: estimated {est:.1f} s in float32, under PROBE_WORTH_S="
            f"{PROBE_WORTH_S:g} s ({basis})"
        )
    run, what = _probe_forward(subject, task) if large and task is not None else (None, "")
    choice = choose_precision(
        "auto",
        run=run,
        device=param.device,
        what=what,
        weights_dtype=param.dtype,
        worth_it=(large, why_small),
        check=None if task is None else lambda: check_bfloat16(model, task),
    )
    record: dict[str, Any] = {"sweep_dtype_choice": choice.reason}
    if choice.probe is not None:
        record["sweep_dtype_probe"] = choice.probe.to_dict()
        if choice.autocast is not None:
            record["sweep_dtype_choice"] += (
                f"; {why_big}; held-out numbers are float32; --sweep-dtype float32 "
                "(sweep_dtype=None) for exact arithmetic"
            )
    return choice.autocast, record


def _probe_forward(model: ModelLike, task: Task, rows: int = 16) -> tuple[Any, str]:
    """The work ``sweep_dtype="auto"`` times: a forward pass like the sweep's own (the last
    position's logits only) on ``rows`` selection prompts of the task's most common length (its
    prompts repeated where it has fewer). Matrix shapes decide which precision is faster (on one
    AVX512-BF16 Xeon a 64-row bfloat16 matmul was 2x slower than float32), so the probe runs
    the sweep's batch, not a toy one."""
    from collections import Counter

    from gna_lens.interventions.runner import Runner

    ids = [list(s.input_ids) for s in task]
    length = Counter(len(i) for i in ids).most_common(1)[0][0]
    same = [i for i in ids if len(i) == length]
    subject = Subject.of(model)
    device = subject.device
    batch = torch.tensor(same, device=device).repeat(-(-rows // len(same)), 1)[:rows]
    runner = Runner(subject)

    def run() -> None:
        with torch.no_grad():
            runner.logits_last(batch)

    return run, f"forward of {len(batch)} x {length} selection tokens, last-position logits"


def check_bfloat16(model: ModelLike, task: Task, n: int = 8) -> tuple[bool, str]:
    """Whether bfloat16 autocast keeps ``model``'s clean logit differences on the first ``n``
    prompts of ``task``: the mean absolute change must stay within 0.1 x the mean absolute
    float32 value + 0.02 logits. Returns ``(ok, the numbers in words)``.

    A guard for ``sweep_dtype="auto"``: trained models run in bfloat16 every day, but a model
    whose mechanism needs float32 (e.g. a hand-built one with huge weights) must not be swept in
    it.
    """
    from gna_lens.tasks import evaluate

    sub = task[: min(n, len(task))]
    with torch.no_grad():
        ref = evaluate(model, sub).logit_diffs.double()
        with sweep_precision(model, "bfloat16"):
            low = evaluate(model, sub).logit_diffs.double()
    change, scale = float((low - ref).abs().mean()), float(ref.abs().mean())
    ok = change <= 0.1 * scale + 0.02
    words = (
        f"clean logit difference on {len(sub)} selection prompts moves by {change:.4f} on "
        f"average under bfloat16 (float32 mean |value| {scale:.4f}; allowed 0.1 x that + 0.02)"
    )
    return ok, words


@contextlib.contextmanager
def sweep_precision(model: ModelLike, dtype: str | None) -> Iterator[str]:
    """Autocast for the ablation sweeps: ``None``/``"float32"`` (none) or ``"bfloat16"``."""
    if dtype in (None, "float32", torch.float32):
        yield "float32"
        return
    if dtype not in ("bfloat16", torch.bfloat16):
        raise GnaLensError(
            f"sweep_dtype={dtype!r}; expected None or 'float32' (exact arithmetic of the model's "
            "own dtype), 'bfloat16' (autocast: faster only where the device has native bfloat16) "
            "or 'auto' (bfloat16 where measured faster)."
        )
    with policy_of(model).autocast("bfloat16"):
        yield "bfloat16 (autocast)"


def default_top_layers(view: Any) -> int:
    """Layers a coarse-to-fine scan ablates head by head: :data:`DEFAULT_TOP_LAYERS` (4: a
    Gather layer and the Aggregate layer after it, twice over), fewer where that many layers
    hold more than :data:`EXACT_ALL_MAX` heads, at least 1.

    Args:
        view: The model's :func:`~gna_lens.heads.head_view`.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> from gna_lens.heads import head_view
        >>> default_top_layers(head_view(tiny_hooked_ssm("mamba2")))  # 8 heads per layer
        4
        >>> default_top_layers(head_view(tiny_hooked_ssm("mamba1")))  # 64 channels per layer
        4
    """
    widest = max((lh.n_heads for lh in view), default=1)
    return max(1, min(DEFAULT_TOP_LAYERS, EXACT_ALL_MAX // max(widest, 1)))


def _resolve_strategy(strategy: Any, prefilter: Any, top_layers: Any, view: Any) -> str:
    """The strategy to run (``"auto"`` resolved), after checking the arguments that go with it."""
    if strategy not in STRATEGIES:
        raise InterventionError(
            f"strategy={strategy!r}; expected one of {STRATEGIES}: 'auto' (exact up to "
            f"{EXACT_ALL_MAX} heads, else coarse_to_fine), 'exact', 'coarse_to_fine' (layers "
            "first, then the heads of the top layers) or 'attribution' (prefilter)."
        )
    if prefilter is not None and (not isinstance(prefilter, int) or prefilter < 1):
        raise InterventionError(f"prefilter={prefilter!r}; expected a positive int or None.")
    if top_layers is not None and (
        not isinstance(top_layers, int) or isinstance(top_layers, bool) or top_layers < 1
    ):
        raise InterventionError(f"top_layers={top_layers!r}; expected a positive int or None.")
    if prefilter is not None and strategy not in ("auto", "attribution"):
        raise InterventionError(
            f"prefilter={prefilter} with strategy={strategy!r}: the prefilter is the attribution "
            "strategy's cut. Fix: strategy='attribution' (or 'auto'), or drop prefilter."
        )
    if top_layers is not None and strategy in ("exact", "attribution"):
        raise InterventionError(
            f"top_layers={top_layers} with strategy={strategy!r}: top_layers is the "
            "coarse-to-fine scan's. Fix: strategy='coarse_to_fine' (or 'auto'), or drop it."
        )
    if strategy != "auto":
        return str(strategy)
    if prefilter is not None:
        return "attribution"
    return "exact" if view.n_heads_total <= EXACT_ALL_MAX else "coarse_to_fine"


def choose_strategy(
    model: ModelLike,
    task: Task,
    strategy: str = "auto",
    *,
    prefilter: int | None = None,
    top_layers: int | None = None,
    exact_budget_s: float = EXACT_BUDGET_S,
) -> tuple[str, str]:
    """Which heads :func:`score_heads` ablates exactly, and why, in words for the report.

    ``"auto"``: every head (``"exact"``) on models with at most :data:`EXACT_ALL_MAX` heads; on a
    CUDA device also above that whenever the estimated time of the task's and the control's
    sweeps is at most ``exact_budget_s`` (estimate: one timed forward of 16 selection prompts,
    per row, times the prompts, times the heads, times the mean share of the layers a head's
    cell runs through, twice for the control); else ``"coarse_to_fine"`` (CPUs, and models too
    large for the budget). ``prefilter`` selects ``"attribution"``.

    Args:
        model: The model (its device decides whether the estimate is made).
        task: The selection prompts.
        strategy: One of :data:`STRATEGIES`.
        prefilter: As :func:`score_heads`.
        top_layers: As :func:`score_heads`.
        exact_budget_s: Seconds an exact scan may take on a GPU.

    Returns:
        ``(strategy, reason)``.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> choose_strategy(model, toy_gna_task(model))
        ('exact', 'auto: exact, every one of the 4 heads (at most 300)')
    """
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    chosen = _resolve_strategy(strategy, prefilter, top_layers, view)
    n = view.n_heads_total
    if strategy != "auto":
        return chosen, f"{chosen} (asked for)"
    if chosen != "coarse_to_fine":
        why = f"every one of the {n} heads (at most {EXACT_ALL_MAX})" if chosen == "exact" else (
            f"prefilter={prefilter} given"
        )  # fmt: skip
        return chosen, f"auto: {chosen}, {why}"
    policy = subject.policy
    if not _estimate_applies(policy):
        return chosen, (
            f"auto: coarse_to_fine, {n} heads (more than {EXACT_ALL_MAX}) on "
            f"{policy.device.type}; an exact scan of every head is chosen only on a GPU whose "
            "estimated time fits exact_budget_s"
        )
    est, basis = _exact_seconds(model, task, view)
    fits = est <= exact_budget_s
    return ("exact" if fits else "coarse_to_fine"), (
        f"auto: {'exact' if fits else 'coarse_to_fine'}, every one of {n} heads estimated at "
        f"{est:.0f} s on {policy.describe()} ({'within' if fits else 'over'} "
        f"exact_budget_s={exact_budget_s:g}; {basis})"
    )


def _estimate_applies(policy: DevicePolicy) -> bool:
    """Whether ``"auto"`` estimates an exact scan (a seam the CPU tests replace)."""
    return policy.is_cuda


def time_per_row(
    model: ModelLike, task: Task, rows: int = 16, repeats: int = 3
) -> tuple[float, str]:
    """Seconds per prompt of a sweep-like forward (:func:`_probe_forward` of ``rows`` prompts):
    the median of ``repeats`` timed runs after a warm-up; and what was timed, in words."""
    run, what = _probe_forward(model, task, rows)
    policy = policy_of(model)
    run()  # warm-up (kernels compiled, memory pools filled)
    times = []
    for _ in range(repeats):
        policy.synchronize()
        t0 = time.perf_counter()
        run()
        policy.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / rows, what


def _exact_seconds(model: ModelLike, task: Task, view: Any) -> tuple[float, str]:
    """Estimated seconds of the task's and the control's exact sweeps over every head."""
    est, basis = _sweep_seconds(model, task, view.n_heads_total)
    return 2 * est, f"{basis} x 2 for the control"


def _sweep_seconds(
    model: ModelLike, task: Task, n_swept: int, repeats: int = 3
) -> tuple[float, str]:
    """Estimated seconds of the task's sweep of ``n_swept`` heads (the mean depth of all heads),
    and its basis in words (``repeats``: timed forwards, as :func:`time_per_row`)."""
    view = Subject.of(model).view
    per_row, what = time_per_row(model, task, repeats=repeats)
    depth = sum((view.n_layers - layer) / view.n_layers for layer, _ in view.heads()) / max(
        view.n_heads_total, 1
    )
    est = n_swept * len(task) * depth * per_row
    return est, (
        f"{per_row * 1e3:.3f} ms per row of a {what} x {len(task)} prompts x "
        f"{n_swept} heads x {depth:.2f} mean depth"
    )


def auto_head_groups(model: HookedModel) -> int | None:
    """The block size ``head_groups="auto"`` gives ``model``, or ``None`` (heads as they are).

    A :class:`~gna_lens.models.HookedSSM` with Mamba-1 layers (Mamba-1, FalconMamba, Jamba)
    without channel groups of its own and with more than :data:`EXACT_ALL_MAX` heads gets
    contiguous blocks of :data:`DEFAULT_CHANNEL_GROUP` channels (the largest divisor of
    ``d_inner`` up to it) in its Mamba-1 layers. Any other model (Transformers, Mamba-2, the
    Mamba-2 hybrids, a small Mamba-1, a Mamba-1 whose groups were set with ``set_head_groups``)
    gets ``None``.

    Examples:
        >>> from gna_lens.testing import tiny_hooked_ssm
        >>> auto_head_groups(tiny_hooked_ssm("mamba1")) is None  # 128 channels: exact as they are
        True
    """
    if not is_hooked_ssm(model) or not model.channel_heads:
        return None
    if model.head_group_spec or head_view(model).n_heads_total <= EXACT_ALL_MAX:
        return None
    d_inner = int(model.cfg.d_inner)
    return max(k for k in range(1, DEFAULT_CHANNEL_GROUP + 1) if d_inner % k == 0)


@contextlib.contextmanager
def applied_head_groups(model: HookedModel, head_groups: Any) -> Iterator[dict[str, Any]]:
    """Inside the block, ``model``'s heads are grouped as ``head_groups`` says; yields what to
    record in a report's ``method`` (``{}`` when nothing changed).

    Args:
        model: ModelLike model :func:`~gna_lens.head_view` takes.
        head_groups: ``"auto"`` (:func:`auto_head_groups`), ``None`` / ``"none"`` (single
            channels on a Mamba-1 model, even where ``set_head_groups`` grouped them; nothing on
            other models), or a spec of :meth:`~gna_lens.models.HookedSSM.set_head_groups` (an
            int block size or ``{layer: size or channel sets}``; Mamba-1 / FalconMamba only).

    Raises:
        InterventionError: For another value, or a spec the model refuses (a Mamba-2 model, a
            size that does not divide ``d_inner``, ...).
    """
    if isinstance(head_groups, str) and head_groups not in ("auto", "none"):
        raise InterventionError(
            f"head_groups={head_groups!r}; expected 'auto' (contiguous blocks of "
            f"{DEFAULT_CHANNEL_GROUP} channels on a Mamba-1 model above {EXACT_ALL_MAX} heads), "
            "None / 'none' (single channels), an int block size or {layer: size or channel sets}."
        )
    mamba1 = is_hooked_ssm(model) and model.channel_heads
    if head_groups == "auto":
        size = auto_head_groups(model)
        if size is None:
            yield {}
            return
        n = head_view(model).n_heads_total
        note = (
            f"auto: {n:,} single-channel heads is more than EXACT_ALL_MAX ({EXACT_ALL_MAX}), so "
            f"each head is a contiguous block of {size} channels (head_groups=None for single "
            f"channels); these (layer, head) indices address blocks: reuse them inside "
            f"`with model.head_groups({size}):`"
        )
        with model.head_groups(size):
            yield {"head_groups_choice": note, "head_group_size": size}
        return
    if head_groups is None or head_groups == "none":
        if not mamba1 or not model.head_group_spec:
            yield {}
            return
        with model.head_groups(None):
            yield {"head_groups_choice": "none: single channels (the model's groups set aside)"}
        return
    if not mamba1:
        raise InterventionError(
            f"head_groups={head_groups!r} on a {type(model).__name__}"
            + (f" ({model.cfg.architecture})" if is_hooked_ssm(model) else "")
            + ": channel groups are for Mamba-1 layers (Mamba-1, FalconMamba, Jamba), whose "
            "heads are single channels; other models' heads are real heads. Fix: "
            "head_groups='auto' or None."
        )
    with model.head_groups(head_groups):
        choice: dict[str, Any] = {"head_groups_choice": f"given: {head_groups!r}"}
        if isinstance(head_groups, int):
            choice["head_group_size"] = head_groups
        yield choice
