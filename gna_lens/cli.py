"""Command line interface: ``gna-lens scan`` (the main job) and ``gna-lens demo``."""

import argparse
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
    from gna_lens.models import load_model
    from gna_lens.scan import scan

    name = args.model or DEFAULT_SCAN_MODEL
    command = "gna-lens " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    try:
        model = load_model(name)
        if getattr(model, "tokenizer", None) is None:
            raise GnaLensError(f"Model {name!r} has no tokenizer; scan needs one to build prompts.")
        result = scan(
            model,
            args.task,
            n_samples=args.n_samples,
            top=args.top,
            out=args.out,
            seed=args.seed,
            command=command,
            progress=not args.json,
        )
    except (GnaLensError, OSError) as err:
        print(f"gna-lens scan: {err}", file=sys.stderr)
        return 2
    df = result.report.to_dataframe().set_index(["layer", "head"]).loc[result.top].reset_index()
    if args.json:
        print(result.json_path.read_text() if result.json_path else result.report.to_json())
        return 0
    print(f"\nModel: {name} ({type(model).__name__}); task: {result.report.task}")
    print(f"Metric: {result.report.metric}, baseline {result.report.baseline:.4f}\n")
    print(f"Top {args.top} heads (most harmful to ablate first):")
    cols = ["layer", "head", "kind", "ablation_effect", "gather_score", "aggregate_score",
            "correct_share", "sharpness"]  # fmt: skip
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print("\nRetrieval vs knowledge (removing the top heads):")
    print(result.knowledge.to_dataframe().to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if result.html_path:
        print(f"\nReport: {result.html_path} (offline HTML), {result.json_path}")
    print(f"Scan time: {result.seconds:.1f} s")
    return 0


#: The model ``gna-lens scan`` studies when given none: the zoo Transformer.
DEFAULT_SCAN_MODEL = "zoo-llama"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gna-lens`` command."""
    parser = argparse.ArgumentParser(prog="gna-lens", description=__doc__)
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
        help=f"zoo name, local HF dir, .gguf file or hub name (default {DEFAULT_SCAN_MODEL})",
    )
    sc.add_argument("--task", default="kv", help="kv, mc (MMLU letter vs cloze) or a records FILE")
    sc.add_argument("--n-samples", type=int, default=48, help="prompts per task")
    sc.add_argument("--top", type=int, default=8, help="heads to report and remove")
    sc.add_argument("--out", default="gna_lens_report", help="folder for report.html / report.json")
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    sc.set_defaults(func=_scan)
    args = parser.parse_args(argv)
    args.argv = None if argv is None else list(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
