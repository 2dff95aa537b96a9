"""Command line interface: ``gna-lens demo`` (and, as the project grows, ``gna-lens scan``)."""

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
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
