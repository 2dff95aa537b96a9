"""Reproduce the G&A paper's findings on the installed models and write the findings page.

``python -m gna_lens.findings --out docs/findings.md`` (or ``make findings``) re-measures every
number of ``docs/findings.md`` from what is installed: SmolLM2-135M-Instruct (packaged Q4_1
GGUF, dequantized) and the zoo (:mod:`gna_lens.zoo`). Nothing is read from a previous run.

The experiments (:mod:`gna_lens.findings.experiments`) reuse the library's own steps
(:func:`~gna_lens.score_heads` with a control, :meth:`~gna_lens.GnaReport.top`,
:func:`~gna_lens.scoring.pair_candidates`, :func:`~gna_lens.scoring.mask_experiment`,
:func:`~gna_lens.retrieval_vs_knowledge`); the page (:mod:`gna_lens.findings.render`) opens with
a status table whose every status follows fixed rules from the numbers.

1. :func:`smollm2_heads`: the heads SmolLM2-135M's KV retrieval needs, removing them vs random
   heads, the prose control, knowledge (MMLU cloze) and the paper's letter format.
2. :func:`zoo_ablation`: the zoo models' top heads removed on held-out splits.
3. :func:`pattern_masks`: keeping only / denying the G&A patterns of the candidate heads.
4. :func:`sharpness_and_capacity`: sharpness of the top heads, KV accuracy vs dictionary size.
5. :func:`hybrid_roles`: which kind of head aggregates in the hybrid.
"""

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gna_lens.findings.experiments import (
    CARD_TASKS,
    ZOO_ALL,
    hybrid_roles,
    k_curve,
    pattern_masks,
    second_probe,
    sharpness_and_capacity,
    smollm2_heads,
    templates_table,
    zoo_ablation,
)
from gna_lens.findings.layers import smollm2_layers, zoo_layers
from gna_lens.findings.render import render_markdown
from gna_lens.findings.status import _layer_results, status_rows
from gna_lens.render.figures import dictionary_figure, pruning_figure
from gna_lens.runtime import choose_threads, cpu_description

__all__ = [
    "ZOO_ALL",
    "hybrid_roles",
    "main",
    "pattern_masks",
    "render_markdown",
    "run_all",
    "sharpness_and_capacity",
    "smollm2_heads",
    "status_rows",
    "zoo_ablation",
    "zoo_markdown",
]


def run_all(
    *,
    progress: bool = True,
    only: Sequence[str] | None = None,
    sweep_dtype: str | None = None,
    checkpoint: Path | None = None,
) -> dict[str, Any]:
    """Run every experiment (or those named in ``only``: ``"1"`` .. ``"10"``); returns the results.

    6: layer pruning (gradual and individual) and dictionary-size curves; 7: the second,
    induction-proof KV probe; 8: each template's top heads removed on both templates; 9: layer
    pruning and dictionary-size curves of SmolLM2 on the induction-proof template; 10: the top 1
    to 16 heads of finding 1's joint walk removed on both templates (diminishing returns), and
    finding 1's masks on the facts template.

    The zoo models are ranked once and the reports shared by findings 2-5.

    Args:
        progress: Progress bars on stderr.
        only: Run only these experiments.
        sweep_dtype: Arithmetic of SmolLM2's selection sweep (``None``: float32).
        checkpoint: A JSON file the results are written to after every experiment; the
            experiments it already holds (from an interrupted run of the same code) are read
            back instead of rerun, and ``results["resumed"]`` lists them.
    """
    import platform

    import transformers

    import gna_lens

    reports: dict[str, Any] = {}
    steps: dict[str, Callable[[], Any]] = {
        "1": lambda: smollm2_heads(progress=progress, sweep_dtype=sweep_dtype),
        "2": lambda: zoo_ablation(progress=progress, reports=reports),
        "3": lambda: pattern_masks(progress=progress, reports=reports),
        "4": lambda: sharpness_and_capacity(progress=progress, reports=reports),
        "5": lambda: hybrid_roles(progress=progress, reports=reports),
        "6": lambda: {
            "smollm2": smollm2_layers(
                heads=_top_labels(results, 4) or ["L16H0", "L18H6", "L8H2", "L17H2"],
                exclude=_top_labels(results, None),
                progress=progress,
            ),
            "zoo": zoo_layers(reports=reports, progress=progress),
        },
        "7": lambda: second_probe(question_top=_top_labels(results, 8), progress=progress),
        "8": lambda: templates_table(
            tops={"question": _top_labels(results, 8), "facts": _top_labels(results, 8, "7")},
            progress=progress,
        ),
        "9": lambda: smollm2_layers(
            heads=_top_labels(results, 4, "7"),
            exclude=_top_labels(results, None) + _top_labels(results, None, "7"),
            template="facts",
            progress=progress,
        ),
        "10": lambda: k_curve(
            order=_joint_order(results),
            masks=results.get("1", {}).get("masks"),
            progress=progress,
        ),
    }
    results: dict[str, Any] = {"seconds": {}}
    done: dict[str, Any] = {}
    if checkpoint is not None and checkpoint.is_file():
        done = json.loads(checkpoint.read_text(encoding="utf-8"))
    t_all = time.perf_counter()
    for key, fn in steps.items():
        if only and key not in only:
            continue
        if key in done:
            results[key] = done[key]
            results["seconds"][key] = done.get("seconds", {}).get(key)
            results.setdefault("resumed", []).append(key)
            print(f"finding {key}: read back from {checkpoint}", file=sys.stderr, flush=True)
            continue
        t0 = time.perf_counter()
        results[key] = fn()
        results["seconds"][key] = round(time.perf_counter() - t0, 1)
        print(f"finding {key}: {results['seconds'][key]:.0f} s", file=sys.stderr, flush=True)
        if checkpoint is not None:
            checkpoint.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    results["seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    results["external"] = _read_external()
    results["environment"] = {
        "gna_lens": gna_lens.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}: {cpu_description()}",
    }
    return results


#: Results the findings page cites but does not rerun (hours of CPU): the hybrid experiments'
#: raw tables, as the Hybrid students page publishes them.
EXTERNAL = {
    "swap": "docs/assets/hybrid_swap_zoo.json",
    "students": "docs/assets/hybrid_smollm2_200k.json",
    "students_controlled": "docs/assets/hybrid_smollm2_controlled.json",
}


def _top_labels(results: dict[str, Any], k: int | None, finding: str = "1") -> list[str]:
    """Finding 1's (or 7's: the facts template's) top heads as labels (the first ``k``;
    ``None``: all of them)."""
    heads = [h["head"] for h in results.get(finding, {}).get("top_heads", [])]
    return heads if k is None else heads[:k]


def _joint_order(results: dict[str, Any]) -> list[str]:
    """Finding 1's joint walk, every head it accepted, as labels (best first)."""
    return [f"L{a}H{b}" for a, b in results.get("1", {}).get("joint", {}).get("heads", [])]


def _write_figures(results: dict[str, Any], assets: Path) -> None:
    """Finding 6's SVG figures under ``assets`` (the names the page links to)."""
    for key, _, r in _layer_results(results):
        assets.mkdir(parents=True, exist_ok=True)
        for kind, fig in (("pruning", pruning_figure), ("dictionary", dictionary_figure)):
            (assets / f"findings_{kind}_{key}.svg").write_text(fig(r[kind]), encoding="utf-8")


def _read_external(root: Path | None = None) -> dict[str, Any]:
    """The raw tables of :data:`EXTERNAL` found under ``root`` (the repository; default: the
    current directory), each with ``"path"`` added; missing ones are left out."""
    out: dict[str, Any] = {}
    for key, rel in EXTERNAL.items():
        path = (root or Path.cwd()) / rel
        if path.is_file():
            out[key] = json.loads(path.read_text()) | {"path": rel}
    return out


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def zoo_markdown() -> str:
    """The zoo page: every shipped model's card (architecture, training, measured accuracy)."""
    from gna_lens import zoo

    lines = [
        "# The zoo",
        "",
        "Small models trained by gna_lens on its synthetic curriculum "
        "(`gna_lens.zoo.curriculum`) and shipped inside the package, so that every example runs "
        "offline. `gna_lens.zoo.load(name)` loads one (a TransformerBridge or a HookedSSM); "
        "`gna_lens.zoo.path(name)` is an ordinary Hugging Face folder; `gna-lens train-zoo` "
        "retrains them. Accuracies are on the held-out splits of `gna_lens.zoo.tasks()`, "
        "measured by `gna-lens train-zoo` on the saved checkpoint and re-measured by the test "
        "suite.",
        "",
        "| model | architecture | parameters | steps | training time | "
        + " | ".join(CARD_TASKS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(CARD_TASKS),
    ]
    for name in zoo.names():
        c = zoo.card(name)
        threads = c.raw["training"].get("threads", "?")
        lines.append(
            f"| `{name}` | `{c.architecture}` | {c.n_params:,} | {c.steps} | "
            f"{c.train_seconds / 60:.0f} min ({threads} thread) | "
            + " | ".join(_pct(c.accuracy.get(t, math.nan)) for t in CARD_TASKS)
            + " |"
        )
    lines += [
        "",
        "Chance: 50% / 25% / 12.5% / 6.25% for KV retrieval with 2 / 4 / 8 / 16 pairs, 25% for "
        "the others. *letter* asks every fact once in MMLU format, with fresh distractors and "
        "order, scored on the letter: the fact comes from the weights, the letter holding it must "
        "be looked up in context. *cloze* scores the very same prompts on the option's text (the "
        "fact alone). *letter-unseen* asks the 60 facts never trained in letter format. Training "
        "times are wall-clock on a 2-core machine shared with other training runs.",
        "",
        "Why a KV column can sit at chance, and what was tried: see [the gotchas]"
        "(gotchas.md#a-small-transformer-trained-from-scratch-does-not-learn-kv-retrieval-on-a-cpu-budget).",
        "",
    ]
    for name in zoo.names():
        c = zoo.card(name)
        lines += [f"## {name}", "", c.raw.get("description", ""), ""]
        train = c.raw["training"]
        extras = ""
        if train.get("aux_prev_tokens"):
            extras = (
                f" Auxiliary training loss: linear probes on the residual stream after layer "
                f"{train['aux_layer']} predict the tokens {train['aux_prev_tokens']} positions "
                f"back (weight {train['aux_weight']}); the probes are discarded."
            )
        if train.get("kv_fraction", 0.5) != 0.5:
            extras += f" {100 * train['kv_fraction']:.0f}% of the batches are KV retrieval."
        if train.get("mamba2_init"):
            extras += " SSM mixers initialized as Mamba-2's (`init_like_mamba2`)."
        if train.get("fan_in_init"):
            extras += " Linear layers drawn with torch's default fan-in init (`fan_in_init`)."
        if train.get("zero_init_residual"):
            extras += (
                " Attention and MLP output projections start at zero (`zero_residual_outputs`)."
            )
        if train.get("embedding_std") is not None:
            extras += f" Embeddings drawn from N(0, {train['embedding_std']})."
        lines += [
            f"{train['steps']} steps of {train['batch_size']} documents, AdamW lr {train['lr']}, "
            f"seed {train['seed']}, final answer-token loss {train['final_loss']}.{extras}",
            "",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gna_lens.findings``: run the experiments and write the page.

    Args:
        argv: Command-line arguments (``--help`` lists them).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m gna_lens.findings",
        description="Re-measure the G&A findings on SmolLM2-135M and the zoo; write a page.",
    )
    parser.add_argument("--out", default="docs/findings.md", help="markdown page to write")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument(
        "--zoo-page", default="docs/zoo.md", help="zoo page written from the cards ('' to skip)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="experiments to run (1-10)")
    parser.add_argument(
        "--render", default=None, help="only re-render the page from a results JSON (no runs)"
    )
    parser.add_argument(
        "--sweep-dtype", default=None, choices=["auto", "float32", "bfloat16"],
        help="arithmetic of SmolLM2's selection sweep (default float32; auto: bfloat16 only where "
        "measured faster and accurate enough, as gna-lens scan; held-out numbers are float32)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the cores idle now)"
    )
    parser.add_argument(
        "--resume", action="store_true",
        help="write the results after every experiment to JSON.partial (JSON: --json, default "
        "findings.json beside --out) and read back the experiments an interrupted run finished",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(Path(args.render).read_text(encoding="utf-8"))
        # The cited external tables (hybrid experiments) are read again: they are not rerun
        # here, and one may have been added since the measurements were taken.
        results["external"] = _read_external()
        command = results.get("command", "make findings")
    else:
        threads, why = choose_threads(args.threads)
        torch.set_num_threads(threads)
        print(f"findings: {why}; {cpu_description()}", file=sys.stderr)
        dtype = None if args.sweep_dtype in (None, "float32") else args.sweep_dtype
        checkpoint = None
        if args.resume:
            json_path = Path(args.json) if args.json else Path(args.out).with_suffix(".json")
            checkpoint = json_path.with_name(json_path.name + ".partial")
        results = run_all(
            progress=not args.no_progress, only=args.only, sweep_dtype=dtype, checkpoint=checkpoint
        )
        argv_text = " ".join(argv if argv is not None else sys.argv[1:])
        command = results["command"] = f"python -m gna_lens.findings {argv_text}".strip()
        if args.json:  # before the page: a rendering error must not lose the measurements
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    page = render_markdown(results, command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(page, encoding="utf-8")
    _write_figures(results, Path(args.out).parent / "assets")
    if args.zoo_page:
        Path(args.zoo_page).write_text(zoo_markdown(), encoding="utf-8")
    print(f"wrote {args.out}" + (f" from {args.render}" if args.render else ""), file=sys.stderr)
    return 0
