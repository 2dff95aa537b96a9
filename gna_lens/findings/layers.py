"""The paper's layer experiments on the models that run here: layer pruning and dictionary size.

Bick, Xing and Gu (2025) remove whole layers from the end of a model and watch in-context
retrieval fall to chance at a few layers while a control holds (gradual pruning), then remove
each layer alone (individual removal); and they measure KV retrieval against the number of
pairs, with the Gather-and-Aggregate heads removed and without. :func:`layer_pruning` and
:func:`dictionary_size_curves` do both with the library's own steps and return JSON-ready dicts,
as the other findings experiments; :mod:`gna_lens.render.figures` draws them as SVG.
"""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gna_lens.errors import InterventionError, TaskError
from gna_lens.findings.experiments import ZOO_ALL, _heads
from gna_lens.heads import Head, HookedModel, Subject
from gna_lens.models.provenance import provenance_of
from gna_lens.render.markdown import head_label
from gna_lens.stats import Estimate
from gna_lens.tasks import Task, TextControl

__all__ = [
    "PRUNING_ORDERS",
    "default_pruning_steps",
    "dictionary_size_curves",
    "layer_pruning",
    "smollm2_layers",
    "zoo_kv_tasks",
    "zoo_layers",
]

#: Which end of the model gradual pruning removes layers from.
PRUNING_ORDERS = ("from_end", "from_start")
#: Gradual-pruning points a default step list aims at (every layer up to this many layers).
DEFAULT_POINTS = 12
#: What a missing dictionary size does: raise, or be recorded in the result's ``"missing"``.
MISSING = ("raise", "skip")
#: What each dictionary-size point reports, from :class:`~gna_lens.scoring.TaskRow`.
_ARMS = ("before", "after", "change", "random_after", "random_change", "vs_random", "p_value")


def _short_name(prov: Any) -> str:
    """The model's name without a folder (``"zoo-llama"``, ``"smollm2-135m"``)."""
    return Path(str(prov.name)).name or str(prov.name)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def default_pruning_steps(n_layers: int) -> list[int]:
    """How many layers gradual pruning removes at each point, by default.

    Every count up to :data:`DEFAULT_POINTS` layers; beyond, every ``ceil(n / 12)``-th count,
    with 1 (the last layer alone) and ``n`` (every layer) always included.

    Args:
        n_layers: The model's layers.

    Returns:
        Increasing counts in ``1..n_layers``.

    Examples:
        >>> default_pruning_steps(4)
        [1, 2, 3, 4]
        >>> default_pruning_steps(30)
        [1, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    """
    stride = max(1, math.ceil(n_layers / DEFAULT_POINTS))
    return sorted({1, n_layers, *range(stride, n_layers + 1, stride)})


def _check_layers(value: Any, n: int, name: str) -> list[int]:
    """``steps`` (counts of layers removed, 1..n) or ``individual`` (layers, 0..n-1), sorted."""
    counts = name == "steps"
    lo, hi = (1, n) if counts else (0, n - 1)
    what = "counts of layers to remove" if counts else "layer indices"
    if value is None:
        return default_pruning_steps(n) if counts else list(range(n))
    if _is_int(value):
        if not 1 <= value <= n:
            raise InterventionError(
                f"{name}={value!r}; an int is a stride, expected 1..{n} (this model has {n} "
                f"layers). Fix: e.g. {name}=2, or a list of {what}."
            )
        return sorted({*range(value, n + 1, value), n} if counts else {*range(0, n, value), hi})
    try:
        items = list(value)
    except TypeError:
        raise InterventionError(
            f"{name}={value!r}; expected None (the default), a stride (int) or a list of {what} "
            f"in {lo}..{hi}" + ("." if counts else ", or () to skip.")
        ) from None
    if counts and not items:
        raise InterventionError(
            f"steps={value!r} is empty; expected layer counts in 1..{n}, e.g. [1, 2, 4]. The "
            "point with no layer removed is always included."
        )
    for k in items:
        if not _is_int(k) or not lo <= k <= hi:
            raise InterventionError(
                f"{name} contains {k!r}; expected {what}, ints in {lo}..{hi} (this model has {n} "
                "layers)."
            )
    return sorted(set(items))


def _at_chance(iv: Estimate, chance: float) -> bool:
    """Whether an accuracy's 95% interval reaches chance (or lies below it)."""
    return not math.isnan(iv.low) and iv.low <= chance


def layer_pruning(
    model: HookedModel,
    task: Task,
    control: Any,
    *,
    order: str = "from_end",
    steps: Any = None,
    individual: Any = None,
    max_rows: int = 64,
    progress: bool = False,
) -> dict[str, Any]:
    """Retrieval accuracy and a control's loss as whole layers are removed: gradually and alone.

    **Gradual pruning** removes the last 1, 2, ... layers cumulatively (``order="from_end"``,
    the paper's; ``"from_start"`` removes the first ones); the point with nothing removed is the
    baseline. **Individual removal** removes each layer alone. A removed layer is the identity
    on the residual stream (:func:`~gna_lens.interventions.remove_layers`, run as one
    :func:`~gna_lens.interventions.layer_sweep` with ``target="block"``, ``mode="zero"``); the
    final norm and the unembedding always stay. Accuracy comes with Wilson 95% intervals; its
    change and the control's loss change with paired 95% bootstrap intervals (over prompts,
    over windows / control prompts).

    Args:
        model: A TransformerBridge or a HookedSSM.
        task: The retrieval task, scored by accuracy over its choices (e.g. KV retrieval).
        control: What needs no in-context retrieval, as
            :func:`~gna_lens.interventions.layer_sweep`'s ``control``: a
            :class:`~gna_lens.tasks.TextControl` (loss in nats/token), a knowledge
            :class:`~gna_lens.tasks.Task` (the answer's loss among its options, nats/answer),
            ``"prose"`` or ``None`` (no control).
        order: ``"from_end"`` (default) or ``"from_start"``.
        steps: Layers removed at each gradual point: ``None`` (:func:`default_pruning_steps`),
            a stride (``2``: 2, 4, ... and every layer) or a list of counts in ``1..n_layers``.
        individual: Layers removed alone: ``None`` (every layer), a stride (``2``: layers 0,
            2, ... and the last one), a list of layers, or ``()`` to skip.
        max_rows: Prompts (control windows) per forward pass.
        progress: Show a progress bar.

    Returns:
        ``{"model", "model_name", "provenance", "task", "n", "chance", "n_layers", "baseline",
        "control", "control_unit", "n_control", "control_before", "order", "gradual", "individual",
        "summary", "method"}``: ``gradual`` has one point per count (``removed``, ``layers``,
        ``label``, ``accuracy``, ``change``, ``control_change``), the first with nothing
        removed; ``individual`` one per layer (``layer``, ``kind`` and the same measures);
        intervals are dicts (``value``, ``low``, ``high``, ``n``, ``method``); ``summary``
        names the first gradual point and the single layers whose accuracy interval reaches
        chance.

    Raises:
        InterventionError: For an unknown ``order``, or ``steps`` / ``individual`` outside the
            model's layers; as :func:`~gna_lens.interventions.layer_sweep` otherwise.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
        >>> model = toy_gna_model()  # Gather head in layer 0, Aggregate head in layer 1
        >>> res = layer_pruning(model, toy_gna_task(model, n_samples=8), toy_control(model))
        >>> [(p["removed"], p["accuracy"]["value"]) for p in res["gradual"]]
        [(0, 1.0), (1, 0.125), (2, 0.125)]
        >>> [(p["layer"], p["accuracy"]["value"], p["control_change"]["value"])
        ...  for p in res["individual"]]
        [(0, 0.125, 0.0), (1, 0.125, 0.0)]
        >>> res["summary"]["first_gradual_at_chance"], res["chance"]
        (1, 0.25)
    """
    from gna_lens.interventions import layer_sweep
    from gna_lens.interventions.layers import layer_infos

    t0 = time.perf_counter()
    if order not in PRUNING_ORDERS:
        raise InterventionError(
            f"order={order!r}; expected one of {PRUNING_ORDERS} ('from_end': the paper's "
            "gradual pruning removes the last layers first)."
        )
    if not isinstance(task, Task) or len(task) == 0:
        raise InterventionError(
            f"layer_pruning got task={task!r}; expected a non-empty gna_lens.tasks.Task "
            "(e.g. kv_retrieval(tokenizer, n_samples=60))."
        )
    n = len(layer_infos(model))
    counts = _check_layers(steps, n, "steps")
    singles = _check_layers(individual, n, "individual")

    def removed_by(k: int) -> tuple[int, ...]:
        return tuple(range(n - k, n)) if order == "from_end" else tuple(range(k))

    cells = list(dict.fromkeys([removed_by(k) for k in counts] + [(layer,) for layer in singles]))
    res = layer_sweep(
        model, task, "accuracy", [list(c) for c in cells], target="block", mode="zero",
        control=control, max_rows=max_rows, progress=progress,
    )  # fmt: skip
    index = {c: i for i, c in enumerate(res.cells)}
    acc, change, ctrl = res.value_intervals(), res.effect_intervals(), res.control_intervals()
    chance = float(task.chance)
    baseline = res.baseline_interval
    base_ctrl = res.control_baseline
    zero = Estimate(0.0, 0.0, 0.0, len(task), "none")
    zero_ctrl = None if base_ctrl is None else Estimate(0.0, 0.0, 0.0, len(base_ctrl), "none")

    def measures(i: int | None) -> dict[str, Any]:
        """Cell ``i``'s accuracy, its change and the control's change (``None``: nothing removed)."""
        if i is None:
            a, c, k = baseline, zero, zero_ctrl
        else:
            a, c, k = acc[i], change[i], ctrl[i] if res.has_control else None
        control = None if k is None else k.to_dict()
        return {"accuracy": a.to_dict(), "change": c.to_dict(), "control_change": control}

    gradual = [{"removed": 0, "layers": [], "label": "none"} | measures(None)]
    gradual += [
        {"removed": k, "layers": list(c), "label": _cells_label(c)} | measures(index[c])
        for k, c in zip(counts, map(removed_by, counts), strict=True)
    ]
    kinds = dict(zip(res.cells, res.kinds, strict=True))
    singles_out = [
        {"layer": layer, "kind": kinds[(layer,)]} | measures(index[(layer,)]) for layer in singles
    ]
    first = next((k for k in counts if _at_chance(acc[index[removed_by(k)]], chance)), None)
    prov = provenance_of(model)
    m = res.method
    return {
        "model": prov.describe(),
        "model_name": _short_name(prov),
        "provenance": prov.to_dict(),
        "task": m["task"],
        "n": len(task),
        "chance": chance,
        "n_layers": n,
        "baseline": baseline.to_dict(),
        "control": m["control"],
        "control_unit": m["control_unit"],
        "n_control": 0 if base_ctrl is None else len(base_ctrl),
        "control_before": None if base_ctrl is None else float(base_ctrl.double().mean()),
        "order": order,
        "gradual": gradual,
        "individual": singles_out,
        "summary": {
            "first_gradual_at_chance": first,
            "individual_at_chance": [
                layer for layer in singles if _at_chance(acc[index[(layer,)]], chance)
            ],
            "at_chance_rule": "the accuracy's Wilson 95% interval reaches chance (low <= chance)",
        },
        "method": {
            "ablation": "whole layers removed: each removed block is the identity on the residual "
            "stream (gna_lens.interventions.remove_layers; run as layer_sweep with "
            "target='block', mode='zero'); the final norm and unembedding stay",
            "order": f"gradual pruning {order.replace('_', ' ')}, cumulative; individual "
            "removal: one layer at a time",
            "steps": counts,
            "individual_layers": singles,
            "metric": "accuracy over the task's choices",
            "intervals": "accuracy: Wilson 95%; accuracy change: paired bootstrap 95% over "
            "prompts; control change: paired bootstrap 95% over windows (control prompts)",
            "path": m["path"],
            "forwards": m["forwards"],
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }


def _cells_label(cell: Sequence[int]) -> str:
    return f"L{cell[0]}" if len(cell) == 1 else f"L{cell[0]}-L{cell[-1]}"


# ----------------------------------------------------------------------------- dictionary size
def zoo_kv_tasks(name: str, *, probe: str | None = "kv-8", n_rank: int = 60) -> dict[int, Task]:
    """A zoo model's KV splits by dictionary size, without the prompts that selected its heads.

    The zoo ships KV splits with 2, 4, 8 and 16 pairs (:func:`gna_lens.zoo.tasks`); the findings
    rank heads on the first ``n_rank`` prompts of the ``probe`` split
    (:func:`~gna_lens.findings.experiments.rank_zoo_model`), which are dropped here.

    Args:
        name: A zoo model (:func:`gna_lens.zoo.names`).
        probe: The split the heads were ranked on (``"kv-8"``), or ``None`` (none of these).
        n_rank: Its selection prompts.

    Returns:
        ``{n_pairs: Task}``, e.g. ``{2: ..., 4: ..., 8: ..., 16: ...}``.

    Examples:
        >>> {n: len(t) for n, t in zoo_kv_tasks("zoo-mamba2").items()}
        {2: 200, 4: 200, 8: 140, 16: 200}
    """
    from gna_lens import zoo

    splits = zoo.tasks(name)
    out: dict[int, Task] = {}
    for key, task in splits.items():
        if key.startswith("kv-"):
            out[int(key[3:])] = task[n_rank:] if key == probe else task  # type: ignore[assignment]
    return dict(sorted(out.items()))


def dictionary_size_curves(
    model: HookedModel,
    heads: Sequence[Head],
    *,
    sizes: Sequence[int] = (2, 4, 8, 16, 32),
    tasks: Mapping[int, Task] | Callable[[int], Task] | None = None,
    n_samples: int = 60,
    random_draws: int = 10,
    seed: int = 0,
    template: Any = "question",
    values: str = "words",
    exclude: Sequence[Head] = (),
    control: TextControl | Task | None = None,
    missing: str = "raise",
    progress: bool = False,
) -> dict[str, Any]:
    """KV retrieval accuracy against dictionary size: nothing removed, ``heads`` removed, and as
    many random heads removed.

    One :func:`~gna_lens.retrieval_vs_knowledge` call measures every size, so every size sees
    the same random head sets (as many heads per layer as ``heads`` where the layers give
    enough distinct sets, else as many per kind: the result says which).

    Args:
        model: A TransformerBridge or a HookedSSM.
        heads: The heads to remove, e.g. a report's ``top(4)``.
        sizes: Dictionary sizes (pairs per prompt).
        tasks: ``None``: build :func:`~gna_lens.tasks.kv_retrieval` on ``model.tokenizer``
            (``n_samples`` prompts, seed ``seed + n``, ``template``, ``values``); a callable
            ``n -> Task``; or ``{n: Task}`` used as given (e.g. :func:`zoo_kv_tasks`).
        n_samples: Prompts per size for built tasks.
        random_draws: Random head sets (0: none; 10 is the paper-grade minimum).
        seed: Seed of the tasks and of the random draws.
        template: KV template of built tasks (``"question"``, ``"paper"``, a ``KVTemplate``).
        values: ``"words"`` or ``"numbers"`` for built tasks.
        exclude: Heads no random set may contain (the ranking's other top heads).
        control: A control whose loss change is reported once (it has no dictionary), or
            ``None``.
        missing: A size without a task (no such split; more pairs than the vocabulary allows):
            ``"raise"`` (default) or ``"skip"`` (listed in the result's ``"missing"`` with the
            reason).
        progress: Show progress bars.

    Returns:
        ``{"model", "model_name", "provenance", "heads", "head_kinds", "sizes",
        "requested_sizes", "missing", "points", "random_sets", "random_matching", "control",
        "method"}``: one point per measured size
        with ``n_pairs``, ``n``, ``chance``, ``task`` and the intervals ``before`` (nothing
        removed, Wilson), ``after`` (``heads`` removed, Wilson), ``change`` (paired bootstrap),
        ``random_after`` / ``random_change`` (bootstrap over draws and prompts), ``vs_random``
        and ``p_value``.

    Raises:
        TaskError: For empty or non-positive ``sizes``, a size without a task with
            ``missing="raise"``, every size missing, or a task whose ``n_pairs`` differs from
            its key.
        GnaLensError: As :func:`~gna_lens.retrieval_vs_knowledge` (e.g. no head left to draw).

    Examples:
        >>> from gna_lens.testing import TOY_AGGREGATE_HEAD, toy_gna_model, toy_gna_task
        >>> model = toy_gna_model()
        >>> res = dictionary_size_curves(model, [TOY_AGGREGATE_HEAD], sizes=(2, 4),
        ...     tasks=lambda n: toy_gna_task(model, n_pairs=n, n_samples=8), random_draws=2)
        >>> [(p["n_pairs"], p["before"]["value"], p["after"]["value"] <= p["chance"])
        ...  for p in res["points"]]
        [(2, 1.0, True), (4, 1.0, True)]
    """
    from gna_lens.scoring import retrieval_vs_knowledge
    from gna_lens.tasks import kv_retrieval

    t0 = time.perf_counter()
    if missing not in MISSING:
        raise TaskError(f"missing={missing!r}; expected one of {MISSING}.")
    if isinstance(sizes, int | str):
        raise TaskError(f"sizes={sizes!r}; expected a list of dictionary sizes, e.g. [2, 4, 8].")
    size_list = list(sizes)
    if not size_list:
        raise TaskError(
            f"sizes={sizes!r} is empty; expected dictionary sizes (pairs per prompt), e.g. "
            "(2, 4, 8, 16, 32)."
        )
    for n in size_list:
        if not _is_int(n) or n < 1:
            raise TaskError(
                f"sizes contains {n!r}; expected positive ints (pairs per prompt), e.g. "
                "(2, 4, 8, 16, 32)."
            )
    if len(set(size_list)) != len(size_list):
        raise TaskError(f"sizes={sizes!r} repeats a size; expected each size once.")
    if not (tasks is None or isinstance(tasks, Mapping) or callable(tasks)):
        raise TaskError(
            f"tasks={tasks!r}; expected None (built with kv_retrieval), a callable n -> Task "
            "or a dict {n_pairs: Task}."
        )
    built: dict[int, Task] = {}
    skipped: list[dict[str, Any]] = []
    for n in sorted(size_list):
        try:  # the KV task with n pairs, or why it cannot be had
            if isinstance(tasks, Mapping):
                if n not in tasks:
                    raise TaskError(f"no split with {n} pairs (given: {sorted(tasks)})")
                task = tasks[n]
            elif tasks is None:
                task = kv_retrieval(
                    model.tokenizer, n_pairs=n, n_samples=n_samples, seed=seed + n,
                    template=template, values=values,  # type: ignore[arg-type]
                )  # fmt: skip
            else:
                task = tasks(n)
        except TaskError as err:
            if missing == "raise":
                raise TaskError(
                    f"sizes contains {n}, but no KV task with {n} pairs can be had: {err}. Fix: "
                    f"drop {n} from sizes, or pass missing='skip' to list it as missing."
                ) from None
            skipped.append({"n_pairs": n, "reason": str(err)})
            continue
        if not isinstance(task, Task) or len(task) == 0:
            raise TaskError(
                f"the task for {n} pairs is {task!r}; expected a non-empty gna_lens.tasks.Task "
                "(e.g. kv_retrieval(tokenizer, n_pairs=n))."
            )
        declared = (task.info or {}).get("n_pairs")
        if declared is not None and declared != n:
            raise TaskError(
                f"the task given for {n} pairs has n_pairs={declared} ({task.name}); expected "
                f"{n}. Fix: key each task by its own dictionary size."
            )
        built[n] = task
    if not built:
        raise TaskError(
            f"sizes={sizes!r}: no size has a KV task ({'; '.join(s['reason'] for s in skipped)})."
            " Fix: pass sizes the tasks cover."
        )
    table = retrieval_vs_knowledge(
        model, heads, {f"kv-{n}": t for n, t in built.items()}, control=control,
        random_draws=random_draws, seed=seed, exclude=exclude, progress=progress,
    )  # fmt: skip
    points = [
        {"n_pairs": n, "n": d["n"], "chance": d["chance"], "task": d["description"]}
        | {k: d[k] for k in _ARMS}
        for n, d in zip(built, (row.to_dict() for row in table.rows), strict=True)
    ]
    subject = Subject.of(model)
    model, view = subject.model, subject.view
    prov = provenance_of(model)
    how = (
        f"kv_retrieval(template={template!r}, values={values!r}), {n_samples} prompts per "
        "size, seed + n_pairs"
        if tasks is None
        else ("given per size" if isinstance(tasks, Mapping) else "built by the given callable")
    )
    return {
        "model": prov.describe(),
        "model_name": _short_name(prov),
        "provenance": prov.to_dict(),
        "heads": [head_label(h) for h in table.heads],
        "head_kinds": [view.kind_of(h) for h in table.heads],
        "sizes": list(built),
        "requested_sizes": sorted(size_list),
        "missing": skipped,
        "points": points,
        "random_sets": [[head_label(h) for h in s] for s in table.random_sets],
        "random_matching": table.method.get("random_sets", "none"),
        "control": table.control.to_dict() if table.control is not None else None,
        "method": {
            "ablation": f"the heads zero-ablated at every position ({table.method.get('mode')})",
            "tasks": how,
            "random_draws": random_draws,
            "random_sets": table.method.get("random_sets", "none"),
            "intervals": table.method.get("intervals", ""),
            "accuracy_path": table.method.get("accuracy_path", ""),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }


# ----------------------------------------------------------------------------- findings runs
def smollm2_layers(
    model: HookedModel | None = None,
    heads: Sequence[Any] = (),
    *,
    n_eval: int = 60,
    n_pairs: int = 6,
    sizes: Sequence[int] = (2, 4, 8, 16, 32),
    random_draws: int = 10,
    exclude: Sequence[Any] = (),
    seed: int = 0,
    steps: Any = None,
    individual: Any = None,
    template: str = "question",
    progress: bool = True,
) -> dict[str, Any]:
    """Both layer experiments on SmolLM2-135M (loaded with ``load_model`` unless given).

    Layer pruning on ``n_eval`` KV prompts (``template``: ``"question"``, which copying can
    answer, or the induction-proof ``"facts"``; ``n_pairs`` word pairs, seed
    ``seed + 1``: :func:`~gna_lens.findings.experiments.smollm2_heads`' held-out prompts) with
    the prose control's evaluation split; dictionary-size curves with ``heads`` removed (e.g.
    that finding's top 4, as labels ``"L16H0"`` or tuples) on ``n_eval`` prompts per size.

    Returns:
        ``{"model", "heads", "pruning": layer_pruning(...), "dictionary":
        dictionary_size_curves(...)}``.

    Raises:
        TaskError: Without ``heads``, or with a label that is not ``"L<layer>H<head>"``.
    """
    from gna_lens.findings.experiments import smollm2_label
    from gna_lens.models import load_model
    from gna_lens.tasks import kv_retrieval, text_control

    chosen = _heads(heads)
    if not chosen:
        raise TaskError(
            "smollm2_layers(heads=()); expected the heads to remove, e.g. smollm2_heads()'s "
            "top 4: [h['head'] for h in result['top_heads'][:4]]."
        )
    model = model if model is not None else load_model("smollm2-135m")
    tok = model.tokenizer
    held = kv_retrieval(
        tok, n_pairs=n_pairs, n_samples=n_eval, seed=seed + 1, template=template,  # type: ignore[arg-type]
        values="words",
    )  # fmt: skip
    pruning = layer_pruning(
        model, held, text_control(tok, split="eval", n_sequences=64), steps=steps,
        individual=individual, progress=progress,
    )  # fmt: skip
    dictionary = dictionary_size_curves(
        model, chosen, sizes=sizes, n_samples=n_eval, random_draws=random_draws, seed=seed,
        exclude=_heads(exclude), missing="skip", template=template, progress=progress,
    )  # fmt: skip
    return {
        "model": smollm2_label(model),
        "template": template,
        "heads": [head_label(h) for h in chosen],
        "pruning": pruning,
        "dictionary": dictionary,
    }


def zoo_layers(
    names: Sequence[str] = ZOO_ALL,
    *,
    n_rank: int = 60,
    n_eval: int = 60,
    top: int = 4,
    sizes: Sequence[int] = (2, 4, 8, 16, 32),
    random_draws: int = 10,
    reports: dict[str, Any] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Both layer experiments on zoo models, with the heads and probe task of the findings.

    Each model's heads are ranked as in :func:`~gna_lens.findings.experiments.zoo_ablation`
    (:func:`~gna_lens.findings.experiments.rank_zoo_model`, reused from ``reports`` when
    given); layer pruning runs on ``n_eval`` held-out prompts of its probe split (KV with 8
    pairs, or letter-format MC) with the cloze evaluation half as the control; the dictionary
    curves remove its top ``top`` heads on the first ``n_eval`` prompts of each KV split
    (:func:`zoo_kv_tasks`: 2, 4, 8, 16 pairs; other sizes are listed as missing), the random
    sets never containing one of its top ``2 * top`` heads.

    Returns:
        One dict per model: ``{"model", "probe", "heads", "pruning", "dictionary"}``.
    """
    from gna_lens import zoo
    from gna_lens.findings.experiments import _zoo_report

    out = []
    for name in names:
        ranked = _zoo_report(name, reports, n_rank=n_rank, progress=progress)
        if reports is not None:
            reports.setdefault(name, ranked)
        model, tasks, probe, report = ranked
        heads = report.top(top)
        held = tasks[probe][n_rank : n_rank + n_eval]
        pruning = layer_pruning(model, held, zoo.control(name, "eval"), progress=progress)
        kv = zoo_kv_tasks(name, probe=probe if probe.startswith("kv-") else None, n_rank=n_rank)
        dictionary = dictionary_size_curves(
            model, heads, sizes=sizes, tasks={n: t[:n_eval] for n, t in kv.items()},
            random_draws=random_draws, exclude=report.top(2 * top), missing="skip",
            progress=progress,
        )  # fmt: skip
        out.append(
            {
                "model": name,
                "probe": probe,
                "heads": [head_label(h) for h in heads],
                "pruning": pruning,
                "dictionary": dictionary,
            }
        )
    return out
