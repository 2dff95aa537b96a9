"""``gna-lens scan``: rank a model's heads for retrieval and write an offline HTML report.

A scan selects heads on one prompt set and measures them on another:

1. **Selection** (``n_samples`` prompts, ``seed``): pattern scores of every head, and each head
   ablated alone on the probe task and on a control that needs no in-context retrieval (prose
   shipped with gna_lens, windows from the first half of the text). Every head is ablated exactly
   on models with at most :data:`EXACT_ALL_MAX` heads; larger models are scanned coarse to fine
   (each layer removed alone on the task and the control, then every head of the ``top_layers``
   best layers ablated), and the report lists the heads never measured and why
   (``strategy="attribution"`` or ``exact=`` ranks by attribution patching instead and confirms
   the ``exact`` best exactly).
2. **Ranking**: the top heads by retrieval effect among those whose control effect is at most
   ``max_control`` nats/token; the generic heads left out are listed with their reasons.
3. **Held-out measurement** (``n_eval`` prompts from other seeds or other records, checked
   disjoint from the selection prompts; control windows from the second half of the text):
   accuracy before / after removing the top heads with 95% intervals, the control's loss change,
   and as many random heads from the same layers, ``random_draws`` times.
"""

import contextlib
import dataclasses
import functools
import html
import importlib.metadata
import json
import platform
import random
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gna_lens.errors import ConfigError, GnaLensError, GnaLensWarning, TaskError
from gna_lens.heads import HookedModel, Subject
from gna_lens.interventions.engine import shared_prefixes
from gna_lens.models.provenance import provenance_of
from gna_lens.runtime import output_folder
from gna_lens.scoring import (
    MAX_CONTROL,
    GnaReport,
    KnowledgeTable,
    resolve_control,
    retrieval_vs_knowledge,
    score_heads,
)
from gna_lens.scoring.knowledge import RANDOM_DRAWS
from gna_lens.scoring.patterns import Head
from gna_lens.scoring.report import JOINT_K
from gna_lens.stats import wilson_interval
from gna_lens.sweep_policy import (
    EXACT_ALL_MAX,
    EXACT_BUDGET_S,
    applied_head_groups,
    choose_strategy,
    default_top_layers,
    time_per_row,
)
from gna_lens.tasks import (
    Task,
    TextControl,
    evaluate,
    kv_retrieval,
    load_mmlu,
    load_records,
    multiple_choice,
)

__all__ = [
    "EXACT_ALL_MAX",
    "ScanEstimate",
    "ScanResult",
    "ScanTasks",
    "build_tasks",
    "default_exact",
    "estimate_scan",
    "load_scan_model",
    "scan",
]


@dataclass(frozen=True)
class ScanTasks:
    """The prompts of a scan.

    Attributes:
        selection: The probe task the heads are ranked on.
        held_out: ``{name: task}`` measured before / after removing the top heads; no prompt is in
            ``selection``.
        control_select: The control of the ranking (``None``: use the scan's ``control``).
        control_eval: The control of the held-out measurement (disjoint from ``control_select``).
        notes: How the sets were made (seeds, templates, disjointness).
    """

    selection: Task
    held_out: dict[str, Task]
    control_select: Any = None
    control_eval: Any = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScanResult:
    """What a scan produced.

    Attributes:
        report: The per-head :class:`~gna_lens.scoring.GnaReport` on the selection prompts.
        knowledge: Held-out accuracy per task before / after removing the top heads, with the
            control and the random baseline.
        top: The top heads (retrieval-specific ranking).
        excluded: The generic heads the ranking left out, with reasons.
        html_path: The HTML report, when written.
        json_path: The JSON report, when written.
        seconds: Wall time of the scan.
        timings: Seconds per stage: ``tasks``, ``heads`` (pattern scores, ablation sweeps on task
            and control; its steps are in ``report.timings``), ``held_out`` and ``report``.
        n_exact: Heads whose effects were measured exactly (the others are listed, with the
            reason, in ``report.unmeasured``).
        tasks: The scan's prompt sets.
        warnings: Things the reader must know (e.g. a model at chance on its probe).
    """

    report: GnaReport
    knowledge: KnowledgeTable
    top: list[tuple[int, int]]
    html_path: Path | None
    json_path: Path | None
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    n_exact: int = 0
    excluded: list[Any] = field(default_factory=list)
    tasks: ScanTasks | None = None
    warnings: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        top = " ".join(f"L{layer}H{head}" for layer, head in self.top)
        return (
            f"ScanResult(top {len(self.top)}: {top}; {self.n_exact} heads ablated exactly, "
            f"{self.seconds:.0f} s; .summary() for the numbers)"
        )

    def summary(self) -> str:
        """The ranking's top heads, the held-out numbers with intervals, and the warnings."""
        parts = [self.report.summary(max(len(self.top), 1)), "Held out, the top heads removed:"]
        parts += [f"  {line}" for line in self.knowledge.format_lines()]
        parts += [f"Warning: {w}" for w in self.warnings]
        return "\n".join(parts)


def _disjoint(held: Task, selection: Task, name: str) -> Task:
    """``held`` without any prompt that is also in ``selection`` (and the check that none is)."""
    seen = {s.prompt for s in selection}
    keep = tuple(s for s in held if s.prompt not in seen)
    if not keep:
        raise TaskError(
            f"held-out task {name!r}: every one of its {len(held)} prompts is also a selection "
            "prompt; pass another seed."
        )
    return dataclasses.replace(held, samples=keep) if len(keep) != len(held) else held


def build_tasks(
    tokenizer: Any,
    task: str = "kv",
    n_samples: int = 24,
    seed: int = 0,
    n_pairs: int = 6,
    *,
    n_eval: int = 48,
    template: str = "question",
    values: str = "words",
) -> ScanTasks:
    """The selection task and the disjoint held-out tasks (a zoo model's: ``zoo.scan_tasks``).

    Args:
        tokenizer: The model's tokenizer.
        task: ``"kv"`` (KV retrieval in ``template`` with ``values``; held out: the same on other
            prompts, and the paper's template (number values, or word values where the
            tokenizer splits numbers) and the induction-proof ``"facts"`` template where
            ``template`` is another), ``"mc"`` (MMLU offline: letter format as the probe; held
            out: letter and its cloze twin on other questions), or a path to a JSON lines / CSV /
            parquet file of multiple-choice records.
        n_samples: Selection prompts.
        seed: Seed of the selection; held-out sets use other seeds or other records.
        n_pairs: Dictionary size for ``"kv"``.
        n_eval: Prompts per held-out task.
        template: ``"kv"``'s template: ``"question"`` (default), ``"paper"`` or ``"facts"``.
        values: ``"kv"``'s values: ``"words"`` (default), ``"numbers"`` or ``"auto"``.

    Returns:
        A :class:`ScanTasks`.

    Raises:
        TaskError: For an unknown task or an empty or unreadable file.
    """
    if task == "kv":
        kw = dict(n_pairs=n_pairs, template=template, values=values)
        probe = kv_retrieval(tokenizer, n_samples=n_samples, seed=seed, **kw)  # type: ignore[arg-type]
        held = {f"kv-{n_pairs}": kv_retrieval(tokenizer, n_samples=n_eval, seed=seed + 1, **kw)}  # type: ignore[arg-type]
        notes = {"template": f"{template}, {probe.info['values']} values"}
        other = functools.partial(kv_retrieval, tokenizer, n_pairs=n_pairs, n_samples=n_eval)
        if template != "paper":
            try:
                paper = other(seed=seed + 2, template="paper", values="numbers")
                notes["paper_template"] = "number values 0-99, as in the paper"
            except TaskError as err:  # e.g. a tokenizer that splits numbers into digits
                paper = other(seed=seed + 2, template="paper", values="words")
                notes["paper_template"] = (
                    f"word values: number values cannot be scored in one token ({str(err)[:160]}...)"
                )
            held[f"kv-{n_pairs}-paper"] = paper
        if template != "facts":
            try:  # the induction-proof template: copying the line after the key cannot answer it
                held[f"kv-{n_pairs}-facts"] = other(seed=seed + 3, template="facts", values="words")
                notes["facts_template"] = (
                    "induction-proof (The k is v. ... What is the k? It is): the question template "
                    "can be answered by copying what followed the key, this one cannot; a drop here "
                    "is retrieval that induction cannot do"
                )
            except TaskError as err:
                notes["facts_template"] = f"not measured: {str(err)[:160]}"
        held = {k: _disjoint(v, probe, k) for k, v in held.items()}
        return ScanTasks(probe, held, notes=notes | {"selection_seed": seed})
    if task == "mc":
        records = load_mmlu()
    else:
        path = Path(task)
        if not path.exists():
            raise TaskError(
                f"--task {task!r} is not 'kv', 'mc' or an existing file; pass one of those "
                "(a file holds multiple-choice records: JSON lines, CSV or parquet)."
            )
        records = load_records(str(path))
        if not records:
            raise TaskError(
                f"--task {task!r}: the file holds no records; expected at least one "
                "multiple-choice record (question, choices, answer) per line or row. Fix the "
                "file, or pass --task kv or --task mc."
            )
    rng = random.Random(seed)
    shuffled = rng.sample(list(records), len(records))
    picked, rest = shuffled[:n_samples], shuffled[n_samples : n_samples + n_eval]
    if not rest:
        raise TaskError(
            f"--task {task!r}: {len(records)} records leave none for the held-out measurement "
            f"after {n_samples} selection prompts. Fix: fewer --n-samples or more records."
        )
    mc = dict(seed=seed, duplicate_options="drop")
    letter = multiple_choice(picked, tokenizer, format="letter", **mc)  # type: ignore[arg-type]
    held = {
        "letter": multiple_choice(rest, tokenizer, format="letter", **mc),  # type: ignore[arg-type]
        "cloze": multiple_choice(rest, tokenizer, format="cloze", **mc),  # type: ignore[arg-type]
    }
    return ScanTasks(
        letter, held, notes={"records": f"{len(picked)} selection, {len(rest)} held out, disjoint"}
    )


def _versions() -> str:
    found = []
    for n in ("gna-lens", "torch", "transformers", "transformer-lens"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{n} {importlib.metadata.version(n)}")
    return ", ".join(found) + f", Python {platform.python_version()}"


def load_scan_model(
    name: str, *, device: str | torch.device = "auto", dtype: torch.dtype | str | None = None
) -> Any:
    """Load a model for :func:`scan`, with errors that say what was passed and the fix.

    Args:
        name: A zoo name (``"zoo-llama"``), a packaged model (``"smollm2-135m"``), a local
            Hugging Face folder, a ``.gguf`` file or a hub name (where a hub is reachable).
        device: Where it runs (:func:`~gna_lens.device.resolve_device`: ``"auto"`` is CUDA
            where there is one).
        dtype: Weights dtype (default float32).

    Returns:
        A ``HookedSSM`` or ``TransformerBridge`` with a tokenizer.

    Raises:
        ConfigError: For an unknown model, an architecture gna_lens cannot scan (not a
            decoder-only causal LM, or one TransformerLens cannot bridge), or no tokenizer.
    """
    from gna_lens.models import load_model
    from gna_lens.models.families import checkpoint_family
    from gna_lens.models.loading import find_mamba_ssm, resolve_name

    hint = (
        "Pass a zoo name (gna_lens.zoo.names(), e.g. 'zoo-llama'), 'smollm2-135m', a local "
        "folder with config.json and weights, a .gguf file, or a hub name where a hub is "
        "reachable."
    )
    resolved = resolve_name(name)  # ConfigError for unknown zoo names and missing .gguf files
    model_type: Any = "mamba_ssm"
    archs: list[str] = []
    own = checkpoint_family(resolved)  # gna_lens's own format (hybrid students)
    if own is not None:
        model_type, archs = own.model_type, [own.hf_class]
    elif find_mamba_ssm(resolved) is None:  # mamba_ssm checkpoints are Mamba / Mamba-2 LMs
        model_type, archs = _check_architecture(name, resolved, hint)
    try:
        model = load_model(  # by its own name: the provenance records what it resolved to
            name, device=device, dtype=dtype or torch.float32
        )
    except (ValueError, KeyError, NotImplementedError) as err:
        if isinstance(err, ConfigError):
            raise
        raise _unsupported(name, model_type, archs, f"{err.__class__.__name__}: {err}") from err
    if getattr(model, "tokenizer", None) is None:
        raise ConfigError(
            f"gna-lens scan {name!r}: the model loaded without a tokenizer; scan builds its "
            "prompts with one. Add the tokenizer files (tokenizer.json, ...) to the folder."
        )
    return model


def _check_architecture(name: str, resolved: str, hint: str) -> tuple[Any, list[str]]:
    """Refuse, before loading weights, a model that is not a decoder-only causal LM; else its
    ``model_type`` and ``architectures``."""
    from gna_lens.models.families import SUPPORTED_MODEL_TYPES

    model_type, archs = _declared_architecture(resolved)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolved)
    except (OSError, ValueError) as err:
        if model_type is not None:
            raise ConfigError(
                f"gna-lens scan {name!r}: its config.json declares model_type {model_type!r}, "
                f"which this transformers version does not know ({err.__class__.__name__}). "
                f"gna_lens scans decoder-only causal LMs: {_hooked_ssm_classes()} (HookedSSM), "
                "or a Transformer that TransformerLens's TransformerBridge supports (Llama, "
                f"Qwen2, GPT-2, ...). {hint}"
            ) from err
        raise ConfigError(
            f"gna-lens scan {name!r}: no model config found ({err.__class__.__name__}). {hint}"
        ) from err
    model_type = config.model_type
    archs = list(getattr(config, "architectures", None) or archs)
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or not archs
    if model_type not in SUPPORTED_MODEL_TYPES and (
        getattr(config, "is_encoder_decoder", False) or not causal
    ):
        raise _unsupported(name, model_type, archs, "it is not a decoder-only causal LM")
    return model_type, archs


def _declared_architecture(path: str) -> tuple[str | None, list[str]]:
    """``model_type`` and ``architectures`` from a local folder's config.json, if readable."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, []
    if not isinstance(data, dict):
        return None, []
    archs = data.get("architectures") or []
    return data.get("model_type"), [str(a) for a in archs]


def _unsupported(name: str, model_type: Any, archs: list[str], why: str) -> ConfigError:
    return ConfigError(
        f"gna-lens scan {name!r}: unsupported architecture {archs or model_type!r} "
        f"(model_type {model_type!r}): {why}. gna_lens scans decoder-only causal LMs: "
        f"{_hooked_ssm_classes()} checkpoints (HookedSSM), or a Transformer that "
        "TransformerLens's TransformerBridge supports (Llama, Qwen2, GPT-2, ...). Pass such a "
        "model, e.g. 'smollm2-135m' or 'zoo-llama'."
    )


def _hooked_ssm_classes() -> str:
    """The Hugging Face classes HookedSSM runs (its family registry), for messages."""
    from gna_lens.models.families import FAMILIES

    return ", ".join(f.hf_class for f in FAMILIES.values())


def default_exact(top: int) -> int:
    """Heads :func:`scan` confirms exactly on models above :data:`EXACT_ALL_MAX` heads:
    ``max(4 * top, 32)``."""
    return max(4 * top, 32)


def _stage(progress: bool, text: str) -> None:
    if progress:
        print(f"gna-lens scan: {text}", file=sys.stderr, flush=True)


def scan(
    model: HookedModel,
    task: str = "kv",
    *,
    n_samples: int = 24,
    n_eval: int = 48,
    top: int = 4,
    out: str | Path | None = "gna_lens_report",
    seed: int = 0,
    exact: int | None = None,
    strategy: str = "auto",
    top_layers: int | None = None,
    head_groups: Any = "auto",
    metric: str = "logit_diff",
    mode: str = "zero",
    positions: Any = None,
    control: Any = "auto",
    max_control: float = MAX_CONTROL,
    random_draws: int = RANDOM_DRAWS,
    sweep_dtype: str | None = "auto",
    tasks: ScanTasks | None = None,
    command: str | None = None,
    name: str | None = None,
    progress: bool = True,
    executor: Any = None,
    exact_budget_s: float = EXACT_BUDGET_S,
    force: bool = False,
    control_scope: str = "needed",
) -> ScanResult:
    """Rank every head of ``model`` for in-context retrieval on selection prompts, then measure
    the top heads on held-out prompts; write the report.

    See the module docs for the three stages. Cost: every head (on models above
    :data:`EXACT_ALL_MAX` heads: every layer, then the heads of the top layers) is ablated on
    ``n_samples`` prompts and on the control's 8 windows of 48 tokens; the held-out stage adds
    ``2 + random_draws`` runs of each held-out task and of the control.

    Args:
        model: A TransformerBridge or a HookedSSM with a tokenizer.
        task: ``"kv"``, ``"mc"`` or a records file (see :func:`build_tasks`).
        n_samples: Selection prompts.
        n_eval: Prompts per held-out task (disjoint from the selection prompts).
        top: Heads to report and remove.
        out: Folder for ``report.html`` and ``report.json`` (``None``: write nothing).
        seed: Seed of the selection prompts (held-out prompts use other seeds).
        exact: Heads confirmed by exact ablation after an attribution prefilter: giving it
            (below the number of heads) selects ``strategy="attribution"``; that strategy's
            default is :func:`default_exact`.
        strategy: As :func:`~gna_lens.scoring.score_heads`' (default ``"auto"``).
        exact_budget_s: As :func:`~gna_lens.scoring.score_heads`'.
        top_layers: As :func:`~gna_lens.scoring.score_heads`'.
        head_groups: As :func:`~gna_lens.scoring.score_heads`', for the whole scan (the held-out
            stage removes the same groups); the report records it.
        metric: Ablation metric of the ranking (``"logit_diff"``, ``"accuracy"``, ...).
        mode: ``"zero"``, ``"mean"`` or ``"resample"`` ablation (of the ranking and the held-out
            measurement; resample takes each prompt's head outputs from the next prompt of the
            same set: each task and control rotated by one).
        positions: ``None`` (every position) or ``"last"``.
        control: ``"auto"`` (default: the zoo's cloze split on a zoo model, else ``"prose"``),
            ``"prose"``, ``None``, or any control of
            :func:`~gna_lens.scoring.resolve_control`; zoo models use their cloze split.
        max_control: Bound of the retrieval-specific ranking (nats/token).
        random_draws: Random head sets of the held-out baseline.
        sweep_dtype: As :func:`~gna_lens.scoring.score_heads`' (default ``"auto"``): the
            selection sweeps only; the held-out numbers are always in the model's dtype.
        tasks: The prompts to use instead of :func:`build_tasks`' (``task``, ``n_samples``,
            ``seed`` and ``n_eval`` are then not used to make them): a zoo model's are
            ``gna_lens.zoo.scan_tasks(model.tokenizer, task)``, its own splits and its cloze
            control.
        command: The command line, recorded in the report.
        name: The model's name in the report (default: from its config).
        progress: Show progress bars and one line per stage (on stderr).
        executor: ``None`` (this process) or a :class:`gna_lens.distributed.RayExecutor`:
            the selection sweeps (every head on the task and the control) are sharded over its
            Ray workers; the rest runs here.
        force: Scan even when the model is not above chance on the selection prompts. Before
            any sweep, the model answers them once; if the 95% interval of its accuracy does not
            lie above chance, the scan stops (a ranking on a task the model does not do says
            nothing about retrieval). ``method["baseline_check"]`` records the check.
        control_scope: As :func:`~gna_lens.scoring.score_heads`', but ``"needed"`` by default:
            the control effect alone only of the heads the joint set can reach (the same top
            heads for a fraction of the control sweep); ``"all"`` for every head's (needed by
            :func:`~gna_lens.scoring.rank_stability`; ``gna-lens scan --control-all``).

    Returns:
        A :class:`ScanResult`.

    Raises:
        TaskError: For an unknown task or an empty task file.
        GnaLensError: If ``top``, ``exact``, ``n_samples`` or ``n_eval`` is not positive,
            ``exact`` comes with a strategy other than ``"auto"`` / ``"attribution"``, ``out``
            is a file, or the model is at chance on the selection prompts and ``force`` is off.
    """

    if top < 1 or (exact is not None and exact < 1) or n_samples < 1 or n_eval < 1:
        raise GnaLensError(
            f"scan: top={top}, exact={exact}, n_samples={n_samples}, n_eval={n_eval}; expected "
            "positive ints."
        )
    output_folder(out, "scan(out=...)")  # checked now: a run is never lost at its end
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    with _timed(timings, "tasks"):
        sets, c_select, c_eval = _prompts(
            model, task, tasks, n_samples, seed, n_eval, control, positions
        )
    probe = sets.selection
    with _timed(timings, "baseline_check"):
        baseline_check = _check_baseline(model, probe, name, force=force)
    with applied_head_groups(model, head_groups) as groups_choice:
        subject = Subject.of(model)  # with the head groups in place; every step below gets it
        strategy, strategy_why, prefilter = _pick_strategy(
            subject, probe, strategy, exact, top, top_layers, exact_budget_s
        )
        how = _plan_in_words(subject.view, strategy, prefilter, top_layers, groups_choice)
        _stage(
            progress,
            f"scoring heads on {len(probe)} selection prompts and the control ({how}; sweep "
            f"{sweep_dtype or 'float32'})",
        )
        with _timed(timings, "heads"):
            report = score_heads(
                subject, probe, control=c_select, metric=metric, mode=mode, positions=positions,
                max_control=max_control, prefilter=prefilter, strategy=strategy,
                top_layers=top_layers, head_groups=head_groups, executor=executor,
                sweep_dtype=sweep_dtype, progress=progress,
                joint_k=max(JOINT_K, top),  # the top heads are removed together: a joint set
                control_scope=control_scope,
            )  # fmt: skip
        if "strategy_choice" in report.method:  # chosen here, before score_heads ran it
            report.method["strategy_choice"] = strategy_why
        if name:
            report = dataclasses.replace(report, model_name=name)
        top_heads, excluded = _top_heads(report, top)
        _stage(
            progress,
            f"held-out prompts: accuracy before / after removing the top {len(top_heads)} heads, "
            f"control, {random_draws} random draws",
        )
        with _timed(timings, "held_out"):
            knowledge = retrieval_vs_knowledge(
                subject, top_heads, sets.held_out, control=c_eval, random_draws=random_draws,
                seed=seed, mode=mode, positions=positions, progress=progress,
                random_if_above_chance=True,
            )  # fmt: skip
    cautions = _warnings(report, knowledge, top, len(top_heads))
    report = dataclasses.replace(
        report,
        method=report.method
        | groups_choice
        | {
            "selection_prompts": len(probe),
            "held_out_prompts": {k: len(v) for k, v in sets.held_out.items()},
            "held_out": "disjoint from the selection prompts (checked by prompt text)",
            "baseline_check": baseline_check,
            "control_eval": knowledge.control.control if knowledge.control else "none",
            **{f"tasks_{k}": v for k, v in sets.notes.items()},
        },
    )
    n_exact = int(report.method.get("n_exact", 0))
    result = ScanResult(
        report, knowledge, top_heads, None, None, time.perf_counter() - t0, timings, n_exact,
        excluded, sets, cautions,
    )  # fmt: skip
    with _timed(timings, "report"):
        if out is not None:
            paths = _write_report(Path(out), subject, result, top, strategy, command)
            result = dataclasses.replace(result, html_path=paths[0], json_path=paths[1])
    return dataclasses.replace(result, seconds=time.perf_counter() - t0)


@contextlib.contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    """Record the seconds the block takes as ``timings[stage]``."""
    clock = time.perf_counter()
    yield
    timings[stage] = time.perf_counter() - clock


def _plan_in_words(
    view: Any, strategy: str, prefilter: int | None, top_layers: int | None, groups: dict[str, Any]
) -> str:
    """Which heads the scan ablates exactly, for the progress line."""
    n_heads = view.n_heads_total
    if strategy == "exact":
        how = f"exact ablation of all {n_heads}"
    elif strategy == "attribution":
        how = f"attribution over all {n_heads}, exact ablation of the {prefilter} it ranks first"
    else:
        k = default_top_layers(view) if top_layers is None else top_layers
        how = (
            f"coarse to fine: each of {view.n_layers} layers removed alone, then exact ablation "
            f"of the heads of the top {k}"
        )
    if groups.get("head_group_size"):
        how += f"; each head a block of {groups['head_group_size']} channels"
    return how


def _top_heads(report: GnaReport, top: int) -> tuple[list[Head], list[Any]]:
    """The top heads the held-out stage removes, and the heads passed over (fewer than asked
    for: the result's warnings say so)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GnaLensWarning)
        if report.has_control:
            return report.top(top), report.excluded(top)
        return report.top(top, by="ablation_effect"), []


def _write_report(
    folder: Path, subject: Subject, result: ScanResult, top: int, strategy: str, command: str | None
) -> tuple[Path, Path]:
    """``report.html`` (offline) and ``report.json`` in ``folder``; ``result``: the scan's so far
    (its ``seconds``: until now)."""
    report, knowledge, n_exact = result.report, result.knowledge, result.n_exact
    folder.mkdir(parents=True, exist_ok=True)
    prov = provenance_of(subject.model)
    method = report.method
    machine = subject.policy.machine()
    esc = html.escape
    lines = [f"Weights: {esc(prov.describe())}"]
    if prov.files:
        lines.append("Weights files: " + esc(", ".join(f"{f} (sha256 {h})" for f, h in prov.files)))
    if prov.revision:
        lines.append(f"Hub revision: {esc(prov.revision)}")
    lines += [
        f"Command: <code>{esc(command or ' '.join(sys.argv))}</code>",
        f"Versions: {esc(_versions())}",
        f"Machine: {esc(machine)}",
        f"Heads ablated exactly: {n_exact} of {subject.view.n_heads_total} (strategy {strategy})",
    ]
    if "executor" in method:
        lines.append(f"Sweeps sharded: {esc(str(method['executor']))}")
    if method.get("head_groups"):
        lines.append(
            esc(method["head_groups"])
            + esc(f" (head groups {method.get('head_groups_choice', 'as set')})")
        )
    stages = describe_timings(result.timings, report.timings)
    lines.append(f"Scan time: {result.seconds:.1f} s ({esc(stages)}; model loading not included)")
    meta = "<h2>Provenance</h2><p>" + "<br>".join(lines) + "</p>"
    warn_html = "".join(f"<p><b>Warning:</b> {esc(w)}</p>" for w in result.warnings)
    html_path = report.to_html(
        folder / "report.html", k=top, extra_html=warn_html + knowledge.to_html() + meta
    )
    json_path = folder / "report.json"
    payload = report.to_dict() | {
        "top": [list(h) for h in result.top],
        "excluded": [e.to_dict() for e in result.excluded],
        "n_exact": n_exact,
        "held_out": knowledge.to_dict(),
        "retrieval_vs_knowledge": knowledge.to_dataframe().to_dict(orient="records"),
        "warnings": result.warnings,
        "provenance": prov.to_dict(),
        "command": command,
        "versions": _versions(),
        "machine": machine,
        "timings": result.timings,
        "timings_heads": report.timings,
    }
    json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return html_path, json_path


@dataclass(frozen=True)
class ScanEstimate:
    """What :func:`scan` would run, counted before it runs, and its cost estimated on this device
    (``gna-lens scan --dry-run``).

    The unit of work is a *row*: one selection prompt through the whole model. Every stage is
    counted in rows: a head's cell runs the layers from the head's own onward (a share of a row),
    control windows and held-out prompts count by their length against the selection prompts'.
    One timed forward of 16 selection prompts gives the seconds per row. It is an estimate: the
    control sweep is counted for every head measured (the scan runs it only on heads that can
    still enter the ranking), the joint walk for :data:`JOINT_K` candidates, pattern scores as
    one forward, every stage in the model's dtype (``--sweep-dtype auto`` may run the selection
    sweeps under bfloat16 autocast where it measures that faster: 2x on a 2-core AMX Xeon for
    SmolLM2-135M), every held-out task with its random sets (the scan skips them on a task the
    model does not do above chance).

    Attributes:
        strategy: The strategy the scan would choose, and ``strategy_why``, its reason.
        n_heads: Addressable heads; ``n_exact``, those ablated exactly.
        rows: Per stage, its work in rows.
        per_row_s: Measured seconds per row (``probe``: what was timed).
        device: The device, in words.
        weights_bytes: The model's parameters and buffers.
        peak_bytes: The process's peak memory after the timed forward (CUDA: peak allocated;
            CPU: peak resident set), or ``None`` where it cannot be read.
    """

    strategy: str
    strategy_why: str
    n_heads: int
    n_exact: int
    rows: dict[str, float]
    per_row_s: float
    probe: str
    device: str
    weights_bytes: int
    peak_bytes: int | None

    @property
    def seconds(self) -> float:
        """The estimated wall time of the scan's stages (loading not included)."""
        return sum(self.rows.values()) * self.per_row_s

    def format_lines(self) -> list[str]:
        """The estimate as text, a stage a line."""
        gib = 2.0**30
        lines = [
            f"Strategy: {self.strategy} ({self.strategy_why})",
            f"Heads: {self.n_heads}, of which {self.n_exact} ablated exactly",
            f"Timed: {self.probe}: {1e3 * self.per_row_s:.2f} ms per row on {self.device}",
        ]
        for stage, rows in self.rows.items():
            lines.append(f"  {stage}: {rows:,.0f} rows, {rows * self.per_row_s:,.1f} s")
        lines.append(
            f"Estimated time: {self.seconds:,.0f} s ({self.seconds / 60:.1f} min) plus loading "
            "(sweeps in the model's dtype: --sweep-dtype auto may take bfloat16 where it is "
            "measured faster; random sets on every held-out task)"
        )
        peak = f"; peak after the timed forward {self.peak_bytes / gib:.2f} GiB" if (
            self.peak_bytes is not None
        ) else ""  # fmt: skip
        lines.append(f"Memory: weights {self.weights_bytes / gib:.2f} GiB{peak}")
        return lines


def estimate_scan(
    model: HookedModel,
    task: str = "kv",
    *,
    n_samples: int = 24,
    n_eval: int = 48,
    top: int = 4,
    seed: int = 0,
    exact: int | None = None,
    strategy: str = "auto",
    top_layers: int | None = None,
    head_groups: Any = "auto",
    positions: Any = None,
    control: Any = "auto",
    random_draws: int = RANDOM_DRAWS,
    tasks: ScanTasks | None = None,
    exact_budget_s: float = EXACT_BUDGET_S,
) -> ScanEstimate:
    """Count the work :func:`scan` would do with these arguments and time one forward pass:
    the cost of the scan, before it runs (the arguments are :func:`scan`'s).

    Returns:
        A :class:`ScanEstimate`.

    Examples:
        >>> from gna_lens.testing import toy_gna_model, toy_gna_task, toy_control
        >>> model = toy_gna_model()
        >>> sets = ScanTasks(toy_gna_task(model, n_samples=8), {"kv": toy_gna_task(model, seed=1)})
        >>> est = estimate_scan(model, tasks=sets, control=None, random_draws=2)
        >>> est.strategy, est.n_exact, sorted(est.rows)
        ('exact', 4, ['ablation', 'baseline_check', 'held_out', 'pattern_scores'])
    """
    sets, c_sel, c_eval = _prompts(model, task, tasks, n_samples, seed, n_eval, control, positions)
    probe = sets.selection
    sel_len = sum(len(s.input_ids) for s in probe) / len(probe)

    def rows_of(prompts: Any, swept: bool = False) -> float:
        if prompts is None:
            return 0.0
        if isinstance(prompts, TextControl):
            return prompts.tokens.numel() / sel_len
        once = 0  # a bridge's head sweep runs a shared prefix once per cell
        if swept and not subject.is_ssm:
            groups = shared_prefixes([s.input_ids for s in prompts]).values()
            once = sum((n - 1) * P for n, P in groups)
        return (sum(len(s.input_ids) for s in prompts) - once) / sel_len

    with applied_head_groups(model, head_groups):
        subject = Subject.of(model)
        view = subject.view
        chosen, why, prefilter = _pick_strategy(
            subject, probe, strategy, exact, top, top_layers, exact_budget_s
        )
        n_layers = view.n_layers
        depths = [(n_layers - layer) / n_layers for layer, _ in view.heads()]
        mean_depth = sum(depths) / max(len(depths), 1)
        n_sel, ctrl = float(len(probe)), rows_of(c_sel)
        rows = {"baseline_check": n_sel, "pattern_scores": n_sel}
        if chosen == "exact":
            n_exact = len(depths)
        elif chosen == "attribution":
            n_exact = int(prefilter or default_exact(top))
            rows["attribution"] = 3 * n_sel  # a forward and a backward pass
        else:
            k = default_top_layers(view) if top_layers is None else top_layers
            widest = sorted((lh.n_heads for lh in view), reverse=True)
            n_exact = sum(widest[:k])
            layer_depth = sum((n_layers - i) / n_layers for i in range(n_layers))
            rows["layers"] = layer_depth * (n_sel + ctrl)
        rows["ablation"] = n_exact * mean_depth * rows_of(probe, swept=True)
        if ctrl:
            # control_scope="needed": its first 2 * joint_k heads (more only if the walk asks)
            rows["control"] = min(n_exact, 2 * JOINT_K) * mean_depth * ctrl
            rows["joint_control"] = min(JOINT_K, n_exact) * ctrl
        held = sum(rows_of(t, swept=True) for t in sets.held_out.values()) + rows_of(c_eval)
        rows["held_out"] = (2 + random_draws) * held
        per_row, what = time_per_row(subject, probe)
        policy = subject.policy
        weights = sum(t.numel() * t.element_size() for t in subject.model.state_dict().values())
        return ScanEstimate(
            strategy=chosen, strategy_why=why, n_heads=view.n_heads_total, n_exact=n_exact,
            rows=rows, per_row_s=per_row, probe=what, device=policy.describe(),
            weights_bytes=int(weights), peak_bytes=_peak_bytes(policy),
        )  # fmt: skip


def _peak_bytes(policy: Any) -> int | None:
    """Peak memory so far: CUDA's peak allocated, else the process's peak resident set."""
    if policy.is_cuda:
        return int(torch.cuda.max_memory_allocated(policy.device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except (ImportError, OSError):
        return None


def describe_timings(timings: dict[str, float], heads: dict[str, float]) -> str:
    """``"tasks 0.1 s, heads 80.2 s (pattern_scores 2.0 s, ...), held_out 40.0 s"``.

    Examples:
        >>> describe_timings({"tasks": 0.1, "heads": 3.0}, {"pattern_scores": 1.0})
        'tasks 0.1 s, heads 3.0 s (pattern_scores 1.0 s)'
    """
    parts = []
    for k, v in timings.items():
        detail = ", ".join(f"{a} {b:.1f} s" for a, b in heads.items()) if k == "heads" else ""
        parts.append(f"{k} {v:.1f} s" + (f" ({detail})" if detail else ""))
    return ", ".join(parts)


def _prompts(
    model: HookedModel, task: str, tasks: ScanTasks | None, n_samples: int, seed: int, n_eval: int,
    control: Any, positions: Any,
) -> tuple[ScanTasks, Any, Any]:  # fmt: skip
    """A scan's prompt sets (``tasks``, else :func:`build_tasks`) and its two controls (the sets'
    own, else ``control``): ``(sets, control of the ranking, control held out)``."""
    sets = tasks or build_tasks(
        model.tokenizer, task, n_samples=n_samples, seed=seed, n_eval=n_eval
    )
    tok = model.tokenizer
    c_select = sets.control_select if sets.control_select is not None else control
    c_eval = sets.control_eval if sets.control_eval is not None else control
    return (
        sets,
        resolve_control(c_select, tok, positions=positions, split="select"),
        resolve_control(c_eval, tok, positions=positions, split="eval"),
    )


def _pick_strategy(
    subject: Subject, probe: Task, strategy: str, exact: int | None, top: int,
    top_layers: int | None, exact_budget_s: float,
) -> tuple[str, str, int | None]:  # fmt: skip
    """``(strategy, why, prefilter)`` of a scan: ``exact`` given below the head count selects
    attribution (confirming that many heads exactly), then :func:`choose_strategy`."""
    n_heads = subject.view.n_heads_total
    prefilter = None
    if strategy == "attribution" or (strategy == "auto" and exact is not None and exact < n_heads):
        prefilter = min(exact or default_exact(top), n_heads)
        strategy = "attribution"
    elif exact is not None and exact < n_heads:
        raise GnaLensError(
            f"scan(exact={exact}, strategy={strategy!r}): exact is the attribution strategy's "
            "number of heads confirmed exactly. Fix: strategy='attribution' (or 'auto'), or drop "
            "exact."
        )
    elif exact is not None and strategy == "auto":
        strategy = "exact"  # exact covers every head
    chosen, why = choose_strategy(
        subject, probe, strategy, prefilter=prefilter, top_layers=top_layers,
        exact_budget_s=exact_budget_s,
    )  # fmt: skip
    return chosen, why, prefilter


def _check_baseline(model: HookedModel, probe: Task, name: str | None, *, force: bool) -> str:
    """The model's accuracy on the selection prompts against chance, before any sweep; stops a
    scan of a model that does not do the task unless ``force``."""
    result = evaluate(model, probe, progress=False)
    hit = wilson_interval(float(result.correct.sum()), len(result))
    text = (
        f"selection accuracy {hit.format(percent=True)} on {len(result)} prompts, chance "
        f"{100 * result.chance:.1f}%"
    )
    if hit.low > result.chance:
        return f"{text}: above chance"
    if force:
        return f"{text}: not above chance; scanned anyway (force)"
    raise GnaLensError(
        f"scan: {name or 'the model'} is not above chance on the selection prompts "
        f"({probe.name}): {text}. A ranking on a task the model does not do says nothing about "
        "retrieval, so no sweep was run. Fix: a model that does the task (smollm2-135m; among "
        "the zoo, zoo-mamba2 or zoo-bamba), more --n-samples if the interval is only wide, or "
        "--force (force=True) to scan anyway."
    )


def _warnings(report: GnaReport, knowledge: KnowledgeTable, asked: int, got: int) -> list[str]:
    """What a reader of the scan must know, from its own numbers."""
    out = []
    if got < asked:
        out.append(
            f"only {got} heads meet the ranking criterion ({report.criterion}); asked for {asked}."
        )
    for r in knowledge.rows:
        if r.before.low <= r.chance:
            out.append(
                f"the model is not above chance on {r.task} (accuracy "
                f"{r.before.format(percent=True)}, chance {100 * r.chance:.1f}%): it does not do "
                "this task, so removing heads cannot show what they do for it"
                + (
                    " (and the ranking, made on it, says nothing about retrieval)."
                    if r is knowledge.rows[0]
                    else "."
                )
            )
    if not report.has_control:
        out.append("no control was measured: the ranking is not retrieval-specific.")
    return out
