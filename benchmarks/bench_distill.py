"""Distillation speed: tokens per second of each stage of ``distill``, and where a step's time goes.

A random Llama-shaped teacher (RMSNorm, RoPE, grouped-query attention at 4 query heads per KV
head, SwiGLU MLP at 4x, tied embeddings, ``d_head`` 64) and a student keeping two of its heads
as attention, every other head an SSM head of ``d_state`` 64, as in the Llama-3.2-1B
distillations; batches of ``--batch`` x ``--length`` tokens. Prints one JSON object:

- ``tokens_per_s``: each stage's tokens over its seconds in ``distill`` (the training loop's
  own clock, probes excluded), a token budget of ``--steps1`` + ``--steps2`` steps;
- ``breakdown_ms``: one step of each stage taken apart and timed piece by piece (median of
  ``--repeats``, the device synchronized around each piece): stage 1's teacher forward up to
  the last SSM layer, the mixers' forwards and backwards; stage 2's teacher forward, student
  forward, KL, backward and optimizer step;
- the machine (CPU model, threads; the GPU's name and peak memory on CUDA) and the config.

The defaults keep it under a minute on one CPU thread. The default shape is small: per token,
attention and SSM work grow with ``length x d_model`` and the projections with ``d_model^2``,
so at ``d_model`` 256 and 512 positions the per-head work weighs 8x more against the
projections than at Llama-3.2-1B's ``d_model`` 2048. ``--hidden 2048 --layers 16 --heads 32
--kv-heads 8 --ffn 8192 --vocab 128256 --batch 16 --length 512 --device cuda --autocast
bfloat16`` is the Llama-3.2-1B shape.

    OMP_NUM_THREADS=1 python benchmarks/bench_distill.py --out bench_distill.json
"""

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """The teacher (a Hugging Face Llama), the student and the texts."""
    from gna_lens.hybrid import build_hybrid
    from gna_lens.testing import tiny_hf_model, tiny_tokenizer

    hf = tiny_hf_model(
        "llama",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.ffn,
        vocab_size=args.vocab,
        max_position_embeddings=max(1024, args.length),
        tie_word_embeddings=True,
    ).to(args.device)
    keep = [(1 % args.layers, 3 % args.heads), (args.layers - 1, 5 % args.heads)]
    student = build_hybrid(hf, keep, d_state=args.d_state, tokenizer=tiny_tokenizer())
    rng = random.Random(0)
    words = ["apple", "river", "stone", "key", "value", "the", "fox", "a", "b", "42", "12", "x"]
    n_texts = args.batch * (args.steps1 + args.steps2 + 2)
    texts = [" ".join(rng.choice(words) for _ in range(args.length)) for _ in range(n_texts)]
    return hf, student, texts


def timed(fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, float]:
    """``fn()`` and its milliseconds (the device synchronized before and after)."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def breakdown(student: Any, hf: Any, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One step of each stage, piece by piece, in milliseconds (median of ``args.repeats``)."""
    from gna_lens import runtime
    from gna_lens.device import HOST, DevicePolicy
    from gna_lens.hybrid import _distill as D

    policy = DevicePolicy.of(student)
    sync = policy.synchronize
    twin = D.teacher_twin(hf, student)
    layers = D._ssm_layers(student)
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, args.length)
    ids = torch.randint(200, shape, generator=gen, device=HOST)  # ids of the tiny tokenizer
    ids, mask = policy.put(ids), policy.put(torch.ones(ids.shape, dtype=torch.bool, device=HOST))
    amp = None if args.autocast == "none" else args.autocast
    params = [p for layer in layers for _, p in D._layer_params(student, layer)]
    opt = torch.optim.AdamW(params, lr=1e-5)
    for p in student.parameters():
        p.requires_grad_(any(p is q for q in params))

    def ctx() -> Any:
        return runtime.autocast(policy.device, amp)

    def stage1() -> dict[str, float]:
        with ctx():
            (inputs, targets), t_teacher = timed(lambda: D._capture(twin, ids, layers), sync)
        fwd = bwd = 0.0
        for layer in layers:
            h, rope = inputs[layer]

            def forward(layer: int = layer, h: Any = h, rope: Any = rope) -> Any:
                with ctx():
                    y = D._mixer(student, layer)(h, None, rope)
                return D._nmse(y, targets[layer], mask)

            loss, t = timed(forward, sync)
            fwd += t
            _, t = timed(loss.backward, sync)
            bwd += t
        _, t_opt = timed(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), sync)
        return {"teacher_forward": t_teacher, "mixers_forward": fwd, "mixers_backward": bwd,
                "optimizer": t_opt}  # fmt: skip

    def stage2() -> dict[str, float]:
        def teacher() -> Any:
            with torch.no_grad(), ctx():
                return twin(ids)

        def student_forward() -> Any:
            with ctx():
                return student(ids)

        t_logits, t_teacher = timed(teacher, sync)
        s_logits, t_student = timed(student_forward, sync)
        loss, t_kl = timed(lambda: D._kl(s_logits, t_logits, mask, 1.0), sync)
        _, t_bwd = timed(loss.backward, sync)
        _, t_opt = timed(lambda: (opt.step(), opt.zero_grad(set_to_none=True)), sync)
        return {"teacher_forward": t_teacher, "student_forward": t_student, "kl": t_kl,
                "backward": t_bwd, "optimizer": t_opt}  # fmt: skip

    out = {}
    state = {k: v.clone() for k, v in student.state_dict().items()}
    for name, fn in (("stage1", stage1), ("stage2", stage2)):
        runs = [fn() for _ in range(args.repeats + 1)][1:]  # the first warms up
        med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
        med["step"] = round(sum(med.values()), 2)
        out[name] = med
    student.load_state_dict(state)
    for p in student.parameters():
        p.requires_grad_(True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--d-state", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps1", type=int, default=4, help="stage 1 steps timed")
    parser.add_argument("--steps2", type=int, default=6, help="stage 2 steps timed")
    parser.add_argument("--repeats", type=int, default=2, help="breakdown repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", default="none", choices=["none", "bfloat16"])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from gna_lens.device import DevicePolicy
    from gna_lens.hybrid import distill

    t_all = time.perf_counter()
    hf, student, texts = build(args)
    policy = DevicePolicy.of(student)
    parts = breakdown(student, hf, args)
    if policy.is_cuda:
        torch.cuda.reset_peak_memory_stats(policy.device)
    steps = args.steps1 + args.steps2
    tokens = args.batch * args.length
    res = distill(
        student, hf, texts, budget=tokens * steps, stage1_share=args.steps1 / steps,
        batch_size=args.batch, max_length=args.length, warmup=2, progress=False,
        autocast=None if args.autocast == "none" else args.autocast,
    )  # fmt: skip
    speed = {
        name: round(t["tokens"] / t["seconds"], 1) if t["seconds"] else None
        for name, t in res.totals.items()
    }
    config = {
        "layers": args.layers, "d_model": args.hidden, "heads": args.heads,
        "kv_heads": args.kv_heads, "d_head": args.hidden // args.heads, "ffn": args.ffn,
        "vocab": args.vocab, "d_state": args.d_state, "batch": args.batch, "length": args.length,
        "attention_heads": student.cfg.attention_heads, "autocast": args.autocast,
    }  # fmt: skip
    report = {
        "what": "distill tokens/s per stage and one step of each taken apart (ms)",
        "tokens_per_s": speed,
        "breakdown_ms": parts,
        "totals": res.totals,
        "probe": res.probe,
        "config": config,
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "device": policy.describe(),
            "peak_memory_bytes": policy.peak_memory(),
            "torch": torch.__version__,
        },
        "seconds": round(time.perf_counter() - t_all, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
