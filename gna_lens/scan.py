"""``gna-lens scan``: rank a model's heads for retrieval and write an offline HTML report."""

import html
import importlib.metadata
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gna_lens.errors import TaskError
from gna_lens.scoring import GnaReport, KnowledgeTable, retrieval_vs_knowledge, score_heads
from gna_lens.tasks import Task, kv_retrieval, load_mmlu, load_records, multiple_choice

__all__ = ["ScanResult", "build_tasks", "scan"]


@dataclass(frozen=True)
class ScanResult:
    """What a scan produced.

    Attributes:
        report: The per-head :class:`~gna_lens.scoring.GnaReport` on the probe task.
        knowledge: Accuracy per task before / after removing the top heads.
        top: The top heads (most harmful to ablate first).
        html_path: The HTML report, when written.
        json_path: The JSON report, when written.
        seconds: Wall time of the scan.
    """

    report: GnaReport
    knowledge: KnowledgeTable
    top: list[tuple[int, int]]
    html_path: Path | None
    json_path: Path | None
    seconds: float


def build_tasks(
    tokenizer: Any, task: str = "kv", n_samples: int = 48, seed: int = 0, n_pairs: int = 6
) -> tuple[Task, dict[str, Task]]:
    """The probe task and the retrieval-vs-knowledge tasks for a scan.

    Args:
        tokenizer: The model's tokenizer.
        task: ``"kv"`` (KV retrieval, question template, word values), ``"mc"`` (MMLU offline:
            letter format as the probe, with its cloze twin), or a path to a JSON lines / CSV /
            parquet file of multiple-choice records.
        n_samples: Prompts per task.
        seed: Seed of the sampling.
        n_pairs: Dictionary size for ``"kv"``.

    Returns:
        ``(probe, {name: task})``.

    Raises:
        TaskError: For an unknown task or an empty or unreadable file.
    """
    if task == "kv":
        probe = kv_retrieval(
            tokenizer, n_pairs=n_pairs, n_samples=n_samples, seed=seed, template="question",
            values="words",
        )  # fmt: skip
        larger = kv_retrieval(
            tokenizer, n_pairs=2 * n_pairs, n_samples=n_samples, seed=seed + 1,
            template="question", values="words",
        )  # fmt: skip
        return probe, {f"kv-{n_pairs}": probe, f"kv-{2 * n_pairs}": larger}
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
            raise TaskError(f"--task {task!r}: the file holds no records; expected at least one.")
    rng = random.Random(seed)
    picked = rng.sample(list(records), min(n_samples, len(records)))
    letter = multiple_choice(
        picked, tokenizer, format="letter", seed=seed, duplicate_options="drop"
    )
    cloze = multiple_choice(picked, tokenizer, format="cloze", seed=seed, duplicate_options="drop")
    return letter, {"letter": letter, "cloze": cloze}


def _versions() -> str:
    names = ["gna-lens", "torch", "transformers", "transformer-lens"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found) + f", Python {platform.python_version()}"


def scan(
    model: Any,
    task: str = "kv",
    *,
    n_samples: int = 48,
    top: int = 8,
    out: str | Path | None = "gna_lens_report",
    seed: int = 0,
    exact: int | None = None,
    command: str | None = None,
    progress: bool = True,
) -> ScanResult:
    """Rank every head of ``model`` for in-context retrieval and write the report.

    Pattern scores for every head; attribution patching ranks every head, and the ``exact`` most
    harmful by attribution are confirmed by exact ablation (all heads when the model has at most
    ``exact`` heads); then accuracy before / after removing the ``top`` heads.

    Args:
        model: A TransformerBridge or a HookedSSM with a tokenizer.
        task: ``"kv"``, ``"mc"`` or a records file (see :func:`build_tasks`).
        n_samples: Prompts per task.
        top: Heads to report and remove.
        out: Folder for ``report.html`` and ``report.json`` (``None``: write nothing).
        seed: Seed of the task sampling.
        exact: Heads to confirm by exact ablation (default ``max(4 * top, 24)``).
        command: The command line, recorded in the report.
        progress: Show progress bars.

    Returns:
        A :class:`ScanResult`.
    """
    t0 = time.perf_counter()
    probe, tasks = build_tasks(model.tokenizer, task, n_samples=n_samples, seed=seed)
    n_exact = exact if exact is not None else max(4 * top, 24)
    from gna_lens.heads import head_view

    n_heads = head_view(model).n_heads_total
    report = score_heads(
        model,
        probe,
        ablation=True,
        prefilter=None if n_heads <= n_exact else n_exact,
        progress=progress,
    )
    top_heads = report.top(top)
    knowledge = retrieval_vs_knowledge(model, top_heads, tasks, progress=progress)
    html_path = json_path = None
    seconds = time.perf_counter() - t0
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        meta = (
            "<h2>Provenance</h2><p>Command: <code>"
            + html.escape(command or " ".join(sys.argv))
            + "</code><br>Versions: "
            + html.escape(_versions())
            + f"<br>Scan time: {seconds:.1f} s</p>"
        )
        html_path = report.to_html(
            folder / "report.html", k=top, extra_html=knowledge.to_html() + meta
        )
        json_path = folder / "report.json"
        payload = report.to_dict() | {
            "top": [list(h) for h in top_heads],
            "retrieval_vs_knowledge": knowledge.to_dataframe().to_dict(orient="records"),
            "command": command,
            "versions": _versions(),
        }
        json_path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return ScanResult(report, knowledge, top_heads, html_path, json_path, seconds)
