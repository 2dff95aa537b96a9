"""Command line interface: ``gna-lens scan`` (the main job), ``gna-lens train-zoo`` and
``gna-lens demo``."""

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from gna_lens.models import load_model
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
    return 0


def _scan(args: argparse.Namespace) -> int:
    from gna_lens.errors import GnaLensError
    from gna_lens.scan import load_scan_model, scan

    name = args.model or DEFAULT_SCAN_MODEL
    command = "gna-lens " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    progress = not args.json
    threads, why = scan_threads(args.threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        if progress:
            print(f"gna-lens scan: loading {name} ({why})", file=sys.stderr, flush=True)
        model = load_scan_model(name)
        load_s = time.perf_counter() - t0
        result = scan(
            model,
            args.task,
            n_samples=args.n_samples,
            top=args.top,
            exact=args.exact,
            out=args.out,
            seed=args.seed,
            command=command,
            name=name,
            progress=progress,
        )
    except (GnaLensError, OSError) as err:
        print(f"gna-lens scan: error: {err}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)
    if args.json:
        print(result.json_path.read_text() if result.json_path else result.report.to_json())
        return 0
    df = result.report.to_dataframe().set_index(["layer", "head"]).loc[result.top].reset_index()
    print(f"\nModel: {name} ({type(model).__name__}); task: {result.report.task}")
    print(f"Metric: {result.report.metric}, baseline {result.report.baseline:.4f}")
    n_heads = len(result.report.heads)
    rest = " (the others ranked by attribution only)" if result.n_exact < n_heads else ""
    print(f"Heads ablated exactly: {result.n_exact} of {n_heads}{rest}\n")
    print(f"Top {len(result.top)} heads (most harmful to ablate first):")
    table = df[list(TABLE_COLUMNS)].dropna(axis=1, how="all")  # attribution: only if computed
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print("\nRetrieval vs knowledge (removing the top heads):")
    print(result.knowledge.to_dataframe().to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if result.html_path:
        print(f"\nReport: {result.html_path} (offline HTML), {result.json_path}")
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    print(f"Time: {load_s + result.seconds:.1f} s (loading {load_s:.1f} s, {stages})")
    return 0


def scan_threads(requested: int | None) -> tuple[int, str]:
    """Torch threads for a scan, and why: ``requested``, else ``OMP_NUM_THREADS``, else the cores
    the load average leaves idle (at least one).

    Torch's threads spin while they wait for each other: on a machine whose cores are busy with
    other jobs, more threads than idle cores make a scan several times slower (SmolLM2 on two
    cores shared with a training job: 6.8 min with two threads, under 2 min with one).
    """
    if requested is not None:
        if requested < 1:
            raise SystemExit(f"gna-lens scan: --threads {requested}; expected a positive int.")
        return requested, f"{requested} torch thread(s) (--threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        return n, f"{n} torch thread(s) (OMP_NUM_THREADS)"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return torch.get_num_threads(), f"{torch.get_num_threads()} torch threads"
    n = max(1, min(cores, round(cores - load)))
    return n, f"{n} torch thread(s): {cores} cores, load average {load:.1f}; --threads to change"


def _train_zoo(args: argparse.Namespace) -> int:
    from gna_lens.zoo.train import train_zoo_main

    return int(train_zoo_main(args.rest))


#: The model ``gna-lens scan`` studies when given none: the zoo Transformer.
DEFAULT_SCAN_MODEL = "zoo-llama"

#: The columns of the table ``gna-lens scan`` prints.
TABLE_COLUMNS = (
    "layer", "head", "kind", "ablation_effect", "attribution", "gather_score",
    "aggregate_score", "correct_share", "sharpness",
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gna-lens`` command."""
    from gna_lens import __version__

    parser = argparse.ArgumentParser(prog="gna-lens", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gna-lens {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="load a model, cache a run, summarize one implicit attention"
    )
    demo.add_argument("model", nargs="?", default=None, help="local checkpoint dir or hub name")
    demo.add_argument("--arch", default="mamba2", help="architecture of the default tiny model")
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
    sc.add_argument("--task", default="kv", help="kv, mc (MMLU letter vs cloze) or a records FILE")
    sc.add_argument("--n-samples", type=int, default=24, help="prompts per task (default 24)")
    sc.add_argument("--top", type=int, default=8, help="heads to report and remove (default 8)")
    sc.add_argument(
        "--exact",
        type=int,
        default=None,
        help="heads confirmed by exact ablation after attribution ranks all of them "
        "(default max(2 * top, 16)); the main cost of a scan",
    )
    sc.add_argument("--out", default="gna_lens_report", help="folder for report.html / report.json")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: OMP_NUM_THREADS if set, else the idle cores, at least 1)",
    )
    sc.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    sc.set_defaults(func=_scan)
    tz = sub.add_parser(
        "train-zoo",
        add_help=False,
        help="train the zoo models (gna-lens train-zoo --help lists its options)",
    )
    tz.set_defaults(func=_train_zoo)
    args, rest = parser.parse_known_args(argv)
    if args.command == "train-zoo":
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.argv = None if argv is None else list(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
