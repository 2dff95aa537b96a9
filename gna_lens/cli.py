"""Command line interface: ``gna-lens scan`` (the main job), ``gna-lens evaluate`` (lm-eval
benchmarks with the top heads removed), ``gna-lens hybrid`` (students keeping the top-k heads
as attention, distilled and measured), ``gna-lens lm-eval`` (lm-eval's own command with the
``gna_lens`` model registered), ``gna-lens train-zoo`` and ``gna-lens demo``."""

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gna_lens.device import DevicePolicy
from gna_lens.heads import HookedModel
from gna_lens.runtime import choose_threads
from gna_lens.testing import ARCHITECTURES

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from gna_lens.models import load_model, provenance_of
    from gna_lens.testing import tiny_checkpoint

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            source = args.model
        else:
            source = str(tiny_checkpoint(args.arch, tmp, seed=0))
            print(f"Default model: a tiny random {args.arch} checkpoint written to {source}")
        model = load_model(source)
    prompt = "Memorize the following dictionary:\napple:12\nriver:47\nstone:3\nThe value of the key 'river' is"
    layer = next(i for i, t in enumerate(model.cfg.layer_types) if t == "ssm")
    name = f"blocks.{layer}.mixer.hook_pattern"
    with torch.no_grad():
        logits, cache = model.run_with_cache(prompt, names_filter=name)
    pattern = cache[name][0]
    _n_heads, n_q, n_k = pattern.shape
    last = pattern[:, -1, :]
    print(f"Model: {type(model).__name__} ({model.cfg.architecture}), {model.cfg.n_layers} layers")
    print(f"Weights: {provenance_of(model).describe()}")
    print(f"Prompt: {n_q} tokens; logits {tuple(logits.shape)}")
    print(f"{name}: shape {tuple(cache[name].shape)} [batch, head_index, query_pos, key_pos]")
    print(f"  lower-triangular: {bool(pattern.triu(1).abs().max() == 0)}")
    print(f"  finite: {bool(torch.isfinite(pattern).all())}")
    top = last.abs().sum(0).topk(min(5, n_k))
    toks = model.to_str_tokens(prompt)
    print("  final-row |attention| summed over heads, top keys:")
    for value, pos in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        print(f"    pos {pos:3d} {toks[pos]!r:>12}  {value:.4f}")
    print(f"Done in {time.perf_counter() - t0:.1f}s")
    print(
        f"The main job (`make demo`): gna-lens scan {DEFAULT_SCAN_MODEL} --dry-run, then without it"
    )
    return 0


def _scan_tasks(model: HookedModel, args: argparse.Namespace, is_zoo: bool) -> Any:
    """The scan's prompts: a zoo model's own splits and cloze control
    (``gna_lens.zoo.scan_tasks``), else :func:`gna_lens.scan.build_tasks` with the task flags."""
    if is_zoo:
        from gna_lens import zoo

        n = dict(n_samples=args.n_samples, n_eval=args.n_eval)
        return zoo.scan_tasks(model.tokenizer, args.task, **n)
    from gna_lens.scan import build_tasks

    kv = dict(n_pairs=args.n_pairs or 6, template=args.template or "question")
    return build_tasks(
        model.tokenizer, args.task, args.n_samples, args.seed, n_eval=args.n_eval,
        values=args.values or "words", **kv,  # type: ignore[arg-type]
    )  # fmt: skip


def _scan(args: argparse.Namespace) -> int:
    from gna_lens.scan import describe_timings, estimate_scan, load_scan_model, scan

    name = args.model or DEFAULT_SCAN_MODEL
    command = "gna-lens " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    progress = not (args.json or args.quiet)
    is_zoo = name.startswith("zoo-")
    kv_flags = [f for f, v in (("--n-pairs", args.n_pairs), ("--template", args.template),
                               ("--values", args.values)) if v is not None]  # fmt: skip
    if kv_flags and (is_zoo or args.task != "kv"):
        where = f"the zoo model {name} (scanned on its own kv-8 split)" if is_zoo else (
            f"--task {args.task!r}"
        )  # fmt: skip
        return _fail(
            "scan",
            f"{', '.join(kv_flags)} set the KV prompts of --task kv on a hub or local model; not "
            f"{where}. Fix: drop them.",
        )
    control = None if args.control == "none" else args.control
    if control not in (None, "prose", "auto"):
        from pathlib import Path

        path = Path(control)
        if not path.is_file():
            return _fail(
                "scan",
                f"--control {control!r}; expected 'auto', 'prose', 'none' or a UTF-8 text file "
                "whose prose is the control.",
            )
        control = path.read_text(encoding="utf-8")
    if is_zoo and args.task not in ("kv", "mc"):
        return _fail(
            "scan",
            f"--task {args.task!r} on the zoo model {name}; expected 'kv' (the zoo's kv-8 split) "
            "or 'mc' (its letter split): zoo models are scanned on their own splits.",
        )

    def work(why: str) -> tuple[Any, float, Any]:
        """``(model, loading seconds, ScanResult or None: --dry-run)``."""
        executor = None
        if args.workers is not None or args.ray_address is not None:
            from gna_lens.distributed import RayExecutor

            # Each worker loads the model by the name it was loaded with here (its provenance).
            executor = RayExecutor(
                workers=args.workers, address=args.ray_address, threads_per_worker=args.threads
            )
        try:
            t0 = time.perf_counter()
            if progress:
                print(f"gna-lens scan: loading {name} ({why})", file=sys.stderr, flush=True)
            model = load_scan_model(name, device=args.device, dtype=args.dtype)
            load_s = time.perf_counter() - t0
            common = dict(
                top=args.top, exact=args.exact, strategy=args.strategy,
                top_layers=args.top_layers, head_groups=args.head_groups, seed=args.seed,
                positions="last" if args.positions == "last" else None, control=control,
                random_draws=args.random_draws, tasks=_scan_tasks(model, args, is_zoo),
            )  # fmt: skip
            if args.dry_run:
                est = estimate_scan(model, args.task, **common)  # type: ignore[arg-type]
                print(f"Dry run of gna-lens scan {name} (nothing measured, nothing written):")
                print(f"Loading: {load_s:.1f} s")
                print("\n".join(est.format_lines()))
                return model, load_s, None
            return model, load_s, scan(
                model, args.task, n_samples=args.n_samples, n_eval=args.n_eval, out=args.out,
                metric=args.metric, mode=args.mode, max_control=args.max_control,
                sweep_dtype=None if args.sweep_dtype == "float32" else args.sweep_dtype,
                **common,  # type: ignore[arg-type]
                command=command, name=name, progress=progress, executor=executor,
                force=args.force, control_scope="all" if args.control_all else "needed",
            )  # fmt: skip
        finally:
            if executor is not None:
                executor.close()

    done = _run("scan", args, work)
    if done is None:
        return 2
    model, load_s, result = done
    if result is None:
        return 0
    if args.json:
        print(result.json_path.read_text() if result.json_path else result.report.to_json())
        return 0
    if args.quiet:
        return 0
    report, method = result.report, result.report.method
    print(f"\nModel: {name} ({type(model).__name__}); task: {report.task}")
    print(f"Weights: {method.get('weights', 'not recorded')}")
    held = ", ".join(f"{k} {v}" for k, v in method["held_out_prompts"].items())
    print(f"Prompts: {method['selection_prompts']} select the heads; held out (disjoint): {held}")
    print(
        f"Method: {method['mode']} ablation at {method['positions']} positions, metric "
        f"{report.metric} (baseline {report.baseline:.4f}), sweep {method.get('sweep_dtype')}"
    )
    if "small model" not in method.get("sweep_dtype_choice", "small model"):
        print(f"  sweep dtype {method['sweep_dtype_choice']}")
    if method.get("forward_paths"):
        paths = "; ".join(f"{op} {', '.join(how)}" for op, how in method["forward_paths"].items())
        print(f"Forward path: {paths}")
    if method.get("head_groups"):
        print(f"Heads: {method['head_groups']}")
        if method.get("head_groups_choice"):
            print(f"  head groups {method['head_groups_choice']}")
    n_heads = len(report.heads)
    strategy = method.get("strategy", "exact")
    rest = ""
    if strategy == "attribution" and result.n_exact < n_heads:
        rest = " (the others ranked by attribution only)"
    elif strategy == "coarse_to_fine":
        rest = (
            f" (coarse to fine: the heads of the top {method.get('top_layers')} of "
            f"{report.n_layers} layers ranked by layer removal)"
        )
    print(f"Heads ablated exactly: {result.n_exact} of {n_heads}{rest}")
    if "executor" in method:
        print(f"Sweeps sharded: {method['executor']}")
    if report.has_control:
        print(
            f"Control: {report.control}, baseline {report.control_baseline:.3f} {report.control_unit}; "
            f"ranking: {report.criterion}"
        )
    print(f"\nTop {len(result.top)} heads (retrieval-specific, most harmful first):")
    if result.top:
        df = report.joint_table(list(result.top))  # + the joint control effect of each prefix
        table = df[list(TABLE_COLUMNS)].dropna(axis=1, how="all")  # unmeasured columns dropped
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    joint = report.joint_set
    n_top = len(result.top)
    if joint is not None and n_top and list(result.top) == list(joint.heads[:n_top]):
        print(
            f"Joint control effect (the top {n_top} removed together, 95% interval): "
            f"{joint.effect(n_top).format(signed=True)} {joint.unit}, bound {joint.bound:g}"
            " (joint_control_effect: each head with those above it; control_effect: alone)"
        )
    if result.excluded:
        print(
            "\nLeft out as generic (their removal, alone or with the heads above, also breaks "
            "the control):"
        )
        for e in result.excluded:
            print(
                f"  L{e.head[0]}H{e.head[1]}: ablation effect {e.ablation_effect:+.3f}; {e.reason}"
            )
    _print_coarse(report)
    print(f"\nHeld-out prompts, removing the top {len(result.top)} together (95% intervals):")
    for line in result.knowledge.format_lines():
        print(f"  {line}")
    for w in result.warnings:
        print(f"\nWarning: {w}")
    if result.html_path:
        print(f"\nReport: {result.html_path} (offline HTML), {result.json_path}")
    stages = describe_timings(result.timings, result.report.timings)
    print(f"Time: {load_s + result.seconds:.1f} s (loading {load_s:.1f} s, {stages})")
    print(f"Machine: {DevicePolicy.of(model).machine()}")
    return 0


def _print_coarse(report: Any, max_lines: int = 8) -> None:
    """The coarse stage's layer ranking and the heads never measured, as text."""
    ranking = report.layer_ranking()
    if ranking is not None:
        unit = report.layers.method.get("control_unit") or ""
        print(
            f"\nLayers ranked by removal (coarse stage: each layer removed alone; "
            f"{report.layers.metric} effect, control effect {unit}):"
        )
        cols = [c for c in COARSE_COLUMNS if c in ranking.columns]
        n_scanned = int(ranking["scanned"].sum())
        table = ranking[cols].dropna(axis=1, how="all").head(max(max_lines, n_scanned + 2))
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
        if len(ranking) > len(table):
            print(f"  ... {len(ranking) - len(table)} more layers in the report")
    if report.unmeasured:
        print(
            f"\nHeads never measured: {report.n_unmeasured} of {len(report.heads)} (effects "
            "blank, not zero):"
        )
        for u in report.unmeasured[:max_lines]:
            print(f"  {u.describe()}")
        if len(report.unmeasured) > max_lines:
            print(f"  ... and {len(report.unmeasured) - max_lines} more layers in the report")


def _evaluate(args: argparse.Namespace) -> int:
    try:
        from gna_lens.lm_eval import compare_models, evaluate_table
    except ImportError as err:
        return _fail(
            "evaluate",
            f"lm-eval is not installed ({err}). Install the extra: pip install 'gna-lens[lmeval]'.",
        )
    models = list(args.model) or ["smollm2-135m"]
    rankings = list(args.ranking or [])
    try:
        ks = _ints(args.remove_top, "--remove-top", "evaluate", "0,10,20,30")
        lengths = _ints(args.state_lengths, "--state-lengths", "evaluate", "0,10,20,30")
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    if len(rankings) not in (0, len(models)):
        return _fail(
            "evaluate",
            f"{len(rankings)} --ranking for {len(models)} models ({', '.join(models)}); give one "
            "per model, in their order, or none (each model ranks its own heads).",
        )
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    progress = not args.quiet
    common = {k: getattr(args, k) for k in (
        "mode", "positions", "batch_size", "metric", "num_fewshot", "ranking_samples",
        "ranking_metric", "random_draws", "random_k", "seed", "out", "dtype", "device",
    )} | dict(
        limit=args.limit if args.limit and args.limit > 0 else None,
        sweep_dtype=None if args.sweep_dtype == "float32" else args.sweep_dtype,
        progress=progress,
    )  # fmt: skip

    def work(why: str) -> Any:
        if progress:
            print(f"gna-lens evaluate: {', '.join(models)} ({why})", file=sys.stderr, flush=True)
        if len(models) == 1:
            return evaluate_table(models[0], tasks, ks, rankings[0] if rankings else None, **common)
        return compare_models(
            models, tasks, ks, rankings or None, state_lengths=lengths,
            state_dtype=args.state_dtype, **common,
        )  # fmt: skip

    table = comparison = _run("evaluate", args, work)
    if table is None:
        return 2
    if progress and len(models) == 1:
        print(f"Weights: {table.method.get('weights', 'not recorded')}")
        print(table.to_markdown())
        print(f"Written: {args.out}/table.md, table.csv, table.json, table.svg, tasks/")
    elif progress:
        print(comparison.to_markdown())
        subs = ", ".join(comparison.method["subfolders"])
        print(f"Written: {args.out}/comparison.md, comparison.csv, comparison.json, state.csv; "
              f"each model's table in {args.out}/{{{subs}}}/")  # fmt: skip
    return 0


def _device_flags(parser: argparse.ArgumentParser, what: str, seed_help: str = "") -> None:
    """``--device`` and ``--dtype``; with ``seed_help``, ``--seed`` and ``--threads`` (as scan)."""
    parser.add_argument(
        "--device", default="auto", type=_device_arg,
        help=f"where {what} runs: auto (CUDA where torch sees one, else the CPU), cpu, cuda, "
        "cuda:N",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="weights dtype (float32); ablation sweeps' arithmetic is --sweep-dtype",
    )  # fmt: skip
    if seed_help:
        parser.add_argument("--seed", type=int, default=0, help=seed_help)
        parser.add_argument(
            "--threads", type=_count_arg(1), default=None, help="torch threads (as scan)"
        )


def _ints(text: str, flag: str, command: str = "hybrid", example: str = "0,4,8") -> list[int]:
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise SystemExit(
            f"gna-lens {command}: error: {flag} {text!r}; expected numbers separated by commas, "
            f"e.g. {example}."
        ) from None


def _hybrid(args: argparse.Namespace) -> int:
    from gna_lens.errors import GnaLensError
    from gna_lens.hybrid import DISTILL_DATA, parse_budget, run_experiment

    keep = _ints(args.keep, "--keep")
    kv_pairs = _ints(args.kv_pairs, "--kv-pairs")
    stages = _ints(args.stages, "--stages")
    seeds = _ints(args.seeds, "--seeds") if args.seeds is not None else None
    choices = [c.strip() for c in args.distill_data.split(",") if c.strip()]
    bad = [c for c in choices if c not in DISTILL_DATA] or ([] if choices else [""])
    if bad:
        return _fail(
            "hybrid",
            f"--distill-data {args.distill_data!r}: {bad[0]!r} is not a choice; expected one of "
            f"{', '.join(DISTILL_DATA)} or several separated by commas (e.g. default,no-kv).",
        )
    budget: Any = args.budget.strip()
    if budget.replace("_", "").isdigit():
        budget = int(budget.replace("_", ""))
    try:
        parse_budget(budget, where="--budget")
    except GnaLensError as err:
        return _fail("hybrid", str(err))
    progress = not args.quiet

    def work(why: str) -> Any:
        if progress:
            print(f"gna-lens hybrid: {args.teacher} ({why})", file=sys.stderr, flush=True)
        return run_experiment(
            args.teacher, keep, budget=budget, stages=stages, seeds=seeds, distill_data=choices,
            kv_pairs=kv_pairs, resume=not args.restart, progress=progress,
            autocast=None if args.autocast == "none" else args.autocast,
            sweep_dtype=None if args.sweep_dtype == "float32" else args.sweep_dtype,
            **{k: getattr(args, k) for k in (
                "out", "d_state", "head_layout", "stage1_share", "seed", "random_draws", "only",
                "kv_template", "n_rank", "n_eval", "n_knowledge", "prose_windows", "train",
                "batch_size", "max_length", "save_students", "device", "dtype",
            )},
        )  # fmt: skip

    table = _run("hybrid", args, work)
    if table is None:
        return 2
    if args.json:
        import json

        print(json.dumps(table.to_dict(), indent=1))
    elif progress:
        print(table.to_markdown())
        print(f"Written: {args.out}/table.md, table.csv, table.json, table.svg")
        pending = table.method.get("pending")
        if pending:
            print(
                f"Left for another run (not selected by --only): {', '.join(pending)}; rerun "
                "with the same options and another --only (or none) to add them."
            )
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    from gna_lens.lm_eval.__main__ import main as lm_eval_main

    return int(lm_eval_main(args.rest))


def _head_groups_arg(text: str) -> str | int | None:
    """``--head-groups``: ``"auto"``, ``"none"`` (``None``) or a positive int block size.

    Examples:
        >>> _head_groups_arg("auto"), _head_groups_arg("none"), _head_groups_arg("64")
        ('auto', None, 64)
    """
    value = text.strip().lower()
    if value in ("auto", "none"):
        return None if value == "none" else "auto"
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1 or not value.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected 'auto' (blocks of 64 channels on Mamba-1 models above 300 "
            "heads), 'none' (single channels) or a positive int block size that divides the "
            "model's d_inner, e.g. 64"
        )
    return size


def _count_arg(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for a count of at least ``minimum``: checked when the command line is
    read, before any model loads.

    Examples:
        >>> _count_arg(1)("24")
        24
        >>> _count_arg(1)("-3")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: '-3': expected a positive int (1 or more)
    """
    want = "a positive int (1 or more)" if minimum == 1 else f"an int of {minimum} or more"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}")
        return value

    parse.__name__ = "count"
    return parse


def _device_arg(text: str) -> str:
    """``--device``: a device this machine has (``auto``, ``cpu``, ``cuda``, ``cuda:N``), checked
    before the model loads (:func:`gna_lens.device.resolve_device`)."""
    from gna_lens.device import resolve_device
    from gna_lens.errors import ConfigError

    try:
        resolve_device(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).replace("device=", "", 1)) from None
    return text


def _out_arg(text: str) -> str:
    """``--out``: a folder, new or existing; an existing file is refused before any work."""
    from pathlib import Path

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is a file; expected a folder to write into (new or existing). Fix: "
            "another --out, or move the file."
        )
    return text


def _task_arg(text: str) -> str:
    """``scan --task``: ``kv``, ``mc`` or an existing file of multiple-choice records."""
    from pathlib import Path

    if text in ("kv", "mc") or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not 'kv', 'mc' or an existing file; pass one of those (a file holds "
        "multiple-choice records: JSON lines, CSV or parquet)"
    )


def _fail(command: str, text: str) -> int:
    """Print ``text`` as the command's error; the exit status 2."""
    print(f"gna-lens {command}: error: {text}", file=sys.stderr)
    return 2


def _run(command: str, args: argparse.Namespace, work: Callable[[str], Any]) -> Any:
    """``work(why)`` with the torch threads of ``--threads`` (``why``: how they were chosen;
    restored after), once ``--out`` is checked (so a run is never lost at its end); ``None``
    where either fails, the error printed as the command's."""
    from gna_lens.errors import GnaLensError
    from gna_lens.runtime import output_folder

    before = torch.get_num_threads()
    try:
        output_folder(args.out, "--out")
        threads, why = choose_threads(args.threads)  # --threads: checked >= 1 by argparse
        torch.set_num_threads(threads)
        return work(why)
    except (GnaLensError, OSError) as err:
        _fail(command, str(err))
        return None
    finally:
        torch.set_num_threads(before)


def _train_zoo(args: argparse.Namespace) -> int:
    from gna_lens.zoo.train import train_zoo_main

    return int(train_zoo_main(args.rest))


#: The model ``gna-lens scan`` studies when given none: the packaged SmolLM2-135M (as ``make
#: demo``, ``evaluate`` and ``hybrid``), which does the default task.
DEFAULT_SCAN_MODEL = "smollm2-135m"

#: The columns of the table ``gna-lens scan`` prints.
TABLE_COLUMNS = (
    "layer", "head", "kind", "role", "ablation_effect", "ablation_effect_low",
    "ablation_effect_high", "control_effect", "joint_control_effect", "specificity",
    "attribution", "gather_score",
    "aggregate_score", "correct_share", "correct_chance",
)  # fmt: skip
#: The columns of the coarse stage's layer ranking ``gna-lens scan`` prints.
COARSE_COLUMNS = ("rank", "layer", "scanned", "kind", "effect", "effect_low", "effect_high",
                  "control_effect", "selectivity")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gna-lens`` command."""
    from gna_lens import __version__

    parser = argparse.ArgumentParser(prog="gna-lens", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gna-lens {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="load a model (default: a tiny random Mamba-2), cache a run, summarize one implicit "
        "attention; the main job, `make demo`, is `gna-lens scan smollm2-135m`",
    )
    demo.add_argument("model", nargs="?", default=None, help="local checkpoint dir or hub name")
    demo.add_argument(
        "--arch", default="mamba2", choices=[a for a in ARCHITECTURES if a != "llama"],
        help="architecture of the default tiny random model (mamba2)",
    )  # fmt: skip
    demo.set_defaults(func=_demo)
    sc = sub.add_parser(
        "scan", help="rank heads for retrieval; print a table, write an HTML report"
    )
    sc.add_argument(
        "model",
        nargs="?",
        default=None,
        help=f"zoo name, local HF dir, .gguf file, smollm2-135m or hub name "
        f"(default {DEFAULT_SCAN_MODEL})",
    )
    sc.add_argument(
        "--task", default="kv", type=_task_arg,
        help="kv (KV retrieval: question template, 6 pairs, word values, unless --template / "
        "--n-pairs / --values say otherwise; zoo models: their own kv-8 split in the paper's "
        "template), mc (MMLU letter vs cloze) or a records FILE",
    )  # fmt: skip
    sc.add_argument(
        "--n-pairs", type=_count_arg(2), default=None, help="--task kv: pairs per prompt (6)"
    )
    sc.add_argument(
        "--template", default=None, choices=["question", "paper", "facts"],
        help="--task kv: the selection prompts' template (question; the others are measured "
        "held out; facts is induction-proof)",
    )  # fmt: skip
    sc.add_argument(
        "--values", default=None, choices=["words", "numbers", "auto"],
        help="--task kv: values (words; numbers 0-99 as the paper; auto: numbers where they "
        "are single tokens)",
    )  # fmt: skip
    sc.add_argument(
        "--n-samples",
        type=_count_arg(1),
        default=24,
        help="selection prompts the heads are ranked on (24)",
    )
    sc.add_argument(
        "--n-eval", type=_count_arg(1), default=48, help="held-out prompts per task, disjoint (48)"
    )
    sc.add_argument(
        "--top", type=_count_arg(1), default=4, help="heads to report and remove (default 4)"
    )
    sc.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "exact", "coarse_to_fine", "attribution"],
        help="which heads are ablated exactly: auto (every head up to 300 heads, else "
        "coarse_to_fine), exact, coarse_to_fine (each layer removed alone first, then every "
        "head of the top layers) or attribution (attribution patching ranks, --exact confirm)",
    )
    sc.add_argument(
        "--top-layers",
        type=_count_arg(1),
        default=None,
        help="coarse_to_fine: layers whose heads are ablated (default 4, fewer where their "
        "heads exceed 300)",
    )
    sc.add_argument(
        "--head-groups",
        type=_head_groups_arg,
        default="auto",
        metavar="{auto,none,N}",
        help="Mamba-1 / FalconMamba heads: auto (default: contiguous blocks of 64 channels on "
        "models above 300 single-channel heads, e.g. mamba-130m; single channels below), none "
        "(single channels) or N (blocks of N channels; N divides d_inner)",
    )
    sc.add_argument(
        "--exact",
        type=_count_arg(1),
        default=None,
        help="attribution strategy: heads confirmed by exact ablation after attribution ranks "
        "all of them (default max(4 * top, 32)); giving it selects that strategy",
    )
    sc.add_argument(
        "--metric", default="logit_diff", choices=["logit_diff", "accuracy", "logprob", "choice_logprob"],
        help="ablation metric of the ranking (accuracy with every head exact: the paper's)",
    )  # fmt: skip
    sc.add_argument(
        "--mode", default="zero", choices=["zero", "mean", "resample"],
        help="ablation mode: zero (the paper's), mean (each head's mean output over the prompts "
        "of the same set) or resample (each prompt's head outputs from the next prompt of the "
        "same set)",
    )  # fmt: skip
    sc.add_argument("--positions", default="all", choices=["all", "last"], help="ablated positions")
    sc.add_argument(
        "--control",
        default="auto",
        help="auto (default: a zoo model's cloze split, else prose), prose (shipped text), none, "
        "or a text FILE",
    )
    sc.add_argument(
        "--max-control", type=float, default=0.1,
        help="heads whose control loss rises more (nats/token) are left out of the ranking",
    )  # fmt: skip
    sc.add_argument(
        "--control-all", action="store_true",
        help="measure every head's control effect alone (default: only the heads the joint "
        "set can reach, in ablation-effect order; the report's method.control_scope says how far)",
    )  # fmt: skip
    sc.add_argument(
        "--random-draws",
        type=_count_arg(0),
        default=10,
        help="random head sets of the baseline (10)",
    )
    sc.add_argument(
        "--sweep-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="arithmetic of the selection sweeps: auto (default: float32 on models of at most 300 "
        "heads; above, bfloat16 autocast only where a probe on this model and device measures it "
        "faster and it passes an accuracy check; the report says what was measured), float32, "
        "or bfloat16 (on a CPU without native bfloat16 it can be 10x slower); held-out numbers "
        "are always float32",
    )  # fmt: skip
    sc.add_argument(
        "--out",
        default="gna_lens_report",
        type=_out_arg,
        help="folder for report.html / report.json",
    )
    sc.add_argument(
        "--seed", type=int, default=0,
        help="seed of the selection prompts; held-out prompts and random sets use others (0)",
    )  # fmt: skip
    sc.add_argument(
        "--threads",
        type=_count_arg(1),
        default=None,
        help="torch threads (default: OMP_NUM_THREADS if set, else the idle cores, at least 1); "
        "with --workers, also each worker's (default: the cores split among the workers)",
    )
    sc.add_argument(
        "--workers", type=_count_arg(1), default=None,
        help="shard the selection sweeps over N Ray workers, one model copy each (needs "
        "gna-lens[ray]; default without --ray-address: this process only)",
    )  # fmt: skip
    sc.add_argument(
        "--ray-address", default=None,
        help="Ray cluster to run the workers on (auto, HEAD:6379, ray://HEAD:10001); default "
        "with --workers: a local Ray instance",
    )  # fmt: skip
    _device_flags(sc, "the model")
    sc.add_argument(
        "--dry-run", action="store_true",
        help="load the model, time one forward pass, print the work (cells per stage), the "
        "estimated time and memory on this device, then stop",
    )  # fmt: skip
    sc.add_argument("--quiet", action="store_true", help="no progress, no table on stdout")
    sc.add_argument(
        "--force", action="store_true",
        help="scan even when the model is not above chance on the selection prompts (checked "
        "before any sweep)",
    )  # fmt: skip
    sc.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    sc.set_defaults(func=_scan)
    ev = sub.add_parser(
        "evaluate",
        help="lm-eval benchmarks with the top 0 / 10 / 20 / 30 heads removed: the paper's table",
    )
    ev.add_argument(
        "model", nargs="*", default=["smollm2-135m"],
        help="smollm2-135m (default), zoo name, local HF dir, .gguf file or hub name; two or more "
        "compare them (the paper's Llama-3.2-3B vs Llamba-3B table, each ranking its own heads) "
        "and write comparison.md with each model's state size",
    )  # fmt: skip
    ev.add_argument(
        "--tasks", default="gna_kv,gna_mmlu_letter,gna_mmlu_cloze",
        help="lm-eval tasks, comma-separated: offline gna_kv, gna_kv_paper, gna_mmlu_letter, "
        "gna_mmlu_cloze, or lm-eval's own (mmlu, lambada_openai, gsm8k, ...; need a hub)",
    )  # fmt: skip
    ev.add_argument("--remove-top", default="0,10,20,30", help="rows: heads removed (0,10,20,30)")
    ev.add_argument(
        "--ranking", default=None, action="append",
        help="report.json of `gna-lens scan` (or a JSON list of [layer, head]); default: rank "
        "on KV-retrieval prompts now; with several models, once per model in their order",
    )  # fmt: skip
    ev.add_argument(
        "--state-lengths", default="2048,8192,32768",
        help="with several models: sequence lengths of the state-size table (2048,8192,32768)",
    )  # fmt: skip
    ev.add_argument(
        "--state-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
        help="with several models: dtype the recurrent states and KV caches are counted in "
        "(bfloat16, as served)",
    )  # fmt: skip
    ev.add_argument("--mode", default="zero", choices=["zero", "mean"], help="ablation mode")
    ev.add_argument(
        "--positions", default="all", choices=["all", "last"],
        help="ablated positions: all, or the last context token of each request",
    )  # fmt: skip
    ev.add_argument(
        "--limit", type=_count_arg(0), default=100, help="items per task (default 100; 0 for all)"
    )
    ev.add_argument("--batch-size", type=_count_arg(1), default=8, help="rows per forward pass (8)")
    ev.add_argument("--metric", default=None, help="metric of every task (default: acc, ...)")
    ev.add_argument(
        "--num-fewshot", type=_count_arg(0), default=None, help="lm-eval's few-shot count"
    )
    ev.add_argument(
        "--ranking-samples", type=_count_arg(1), default=16,
        help="KV prompts the ranking is made on when --ranking is not given (16)",
    )  # fmt: skip
    ev.add_argument(
        "--ranking-metric", default=None, choices=["logit_diff", "accuracy"],
        help="metric of the ranking made when --ranking is not given: logit_diff (default) or "
        "accuracy (the paper's protocol: every head ablated alone, accuracy drop)",
    )  # fmt: skip
    ev.add_argument(
        "--random-draws", type=_count_arg(0), default=0,
        help="extra rows random-K #1..#N, each removing K random heads outside the top K, "
        "layer-matched, and their mean (0: none)",
    )  # fmt: skip
    ev.add_argument(
        "--random-k", type=_count_arg(1), default=None,
        help="heads per random row, one of --remove-top (default: its largest)",
    )  # fmt: skip
    ev.add_argument(
        "--sweep-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
        help="arithmetic of the ranking sweeps when the ranking is computed here (auto: as scan)",
    )  # fmt: skip
    ev.add_argument(
        "--out", default="gna_lens_table", type=_out_arg, help="folder for table.md/csv/json/svg"
    )
    _device_flags(ev, "the model", "seed of the ranking prompts and random sets (0)")
    ev.add_argument("--quiet", action="store_true", help="no progress, no table on stdout")
    ev.set_defaults(func=_evaluate)
    hy = sub.add_parser(
        "hybrid",
        help="students keeping the top-k retrieval heads (or k random ones) as attention, the "
        "rest SSM heads: distill and measure",
    )
    hy.add_argument(
        "teacher", nargs="?", default="smollm2-135m",
        help="Llama-style teacher: smollm2-135m (default), a local HF folder, a .gguf file, a zoo "
        "name (zoo-llama) or a hub name",
    )  # fmt: skip
    hy.add_argument(
        "--keep", default="0,4,8", help="heads kept as attention, one student per k (0,4,8)"
    )
    hy.add_argument(
        "--budget", default="200k tokens",
        help="distillation budget per student: tokens (200000, '2M tokens') or time ('20 min')",
    )  # fmt: skip
    hy.add_argument(
        "--out", default="gna_lens_hybrid", type=_out_arg, help="folder for table.md/csv/json/svg"
    )
    hy.add_argument("--d-state", type=_count_arg(1), default=16, help="SSM heads' state size (16)")
    hy.add_argument(
        "--head-layout", default="head", choices=["head", "kv_group"],
        help="SSM heads of the students: one per attention head (head) or per KV group",
    )  # fmt: skip
    hy.add_argument("--stages", default="1,2", help="distillation stages (1,2)")
    hy.add_argument(
        "--stage1-share", type=float, default=0.25, help="share of the budget for stage 1 (0.25)"
    )
    hy.add_argument(
        "--train", default="ssm", choices=["ssm", "mixers", "all"], help="what stage 2 trains"
    )
    hy.add_argument(
        "--random-draws", type=_count_arg(0), default=1,
        help="random-head students per k and training seed, each seed with its own "
        "layer-matched sets (1; 5 or more per seed for a controlled comparison)",
    )  # fmt: skip
    hy.add_argument(
        "--distill-data", default="default",
        help="distillation data: default (KV texts, prose, MMLU) or no-kv (prose and MMLU, no KV "
        "text); several separated by commas (default,no-kv) distil every student on each",
    )  # fmt: skip
    hy.add_argument(
        "--seeds", default=None,
        help="training seeds, each student distilled once per seed (data seed, SSM init, data "
        "order), e.g. 0,1 (default: --seed)",
    )  # fmt: skip
    hy.add_argument(
        "--only", default=None,
        help="distil only these rows now, comma separated: an arm (top-8, random-8, "
        "'random-8 #2', k=0), seed=N, data=CHOICE, or an arm with either ('top-8 seed=1'); "
        "finished rows of the same settings are read back, the rest left for another run",
    )  # fmt: skip
    hy.add_argument("--kv-pairs", default="4,8,16", help="held-out dictionary sizes (4,8,16)")
    hy.add_argument(
        "--kv-template", default=None, choices=["question", "paper"],
        help="held-out KV template (default question; zoo teachers: their own splits)",
    )  # fmt: skip
    hy.add_argument("--n-rank", type=_count_arg(1), default=24, help="selection prompts (24)")
    hy.add_argument(
        "--n-eval", type=_count_arg(1), default=64, help="held-out prompts per KV size (64)"
    )
    hy.add_argument(
        "--n-knowledge", type=_count_arg(0), default=100, help="MMLU cloze questions (100; 0: none)"
    )
    hy.add_argument(
        "--prose-windows", type=_count_arg(1), default=16, help="held-out prose windows (16)"
    )
    hy.add_argument(
        "--batch-size", type=_count_arg(1), default=8, help="texts per distillation step (8)"
    )
    hy.add_argument("--max-length", type=_count_arg(2), default=256, help="tokens per text (256)")
    hy.add_argument(
        "--autocast", default="none", choices=["none", "auto", "bfloat16"],
        help="distillation in mixed precision: bfloat16 (~2x faster on AVX512-BF16 CPUs and GPUs, "
        "far slower on CPUs without native bfloat16) or auto (bfloat16 where a timed training "
        "step says it is faster and its loss stays within 2%%)",
    )  # fmt: skip
    hy.add_argument(
        "--sweep-dtype", default="float32", choices=["auto", "float32", "bfloat16"],
        help="arithmetic of the ranking's ablation sweeps (auto: as scan; held-out numbers are "
        "float32)",
    )  # fmt: skip
    _device_flags(
        hy, "the teacher and the students",
        "training seed when --seeds is not given; also of the ranking prompts (0)",
    )  # fmt: skip
    hy.add_argument(
        "--save-students", action="store_true", help="save each student under OUT/students"
    )
    hy.add_argument(
        "--restart", action="store_true", help="ignore finished rows and checkpoints in OUT"
    )
    hy.add_argument("--quiet", action="store_true", help="no progress, no table on stdout")
    hy.add_argument("--json", action="store_true", help="print the table as JSON")
    hy.set_defaults(func=_hybrid)
    for name, func, about in (
        ("lm-eval", _lm_eval,
         "lm-eval's own command with --model gna_lens available (gna-lens lm-eval --help)"),
        ("train-zoo", _train_zoo,
         "train the zoo models (gna-lens train-zoo --help lists its options)"),
    ):  # fmt: skip
        sub.add_parser(name, add_help=False, help=about).set_defaults(func=func)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("train-zoo", "lm-eval"):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.argv = None if argv is None else list(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
