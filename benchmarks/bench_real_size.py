"""Cost of the scan's stages on real-size SSM configs, with random weights (nothing downloaded).

Builds HookedSSM models from the real configs of ``state-spaces/mamba-130m-hf`` (Mamba-1: 24
layers, d_model 768, d_inner 1536, d_state 16, vocab 50280) and ``state-spaces/mamba2-130m``
(Mamba-2: 24 layers, d_model 768, 24 heads of 64, d_state 128, 1 group, chunk 256), and times on
KV-retrieval prompts (word-level tokenizer, 8 pairs: 47 tokens each):

- ``forward``: one no-grad forward of the prompts (reference);
- ``pattern_scores``: :func:`gna_lens.scoring.pattern_scores` over every head;
- ``attribute_heads``: :func:`gna_lens.interventions.attribute_heads` over every head.

Each (model, stage) runs in its own subprocess, so its peak RSS (``ru_maxrss``) is its own; a
stage that passes ``--timeout`` is reported as not finished. Prints a markdown table.

Usage::

    python benchmarks/bench_real_size.py                      # every model and stage
    python benchmarks/bench_real_size.py --models mamba1-130m --stages pattern_scores
    python benchmarks/bench_real_size.py --n-prompts 16 --timeout 1200 --json out.json
    python benchmarks/bench_real_size.py --extrapolate --models   # 7B models, extrapolated
    # the whole gna-lens scan (random weights are not above chance: --force); for a side-by-side
    # comparison run two at once, PYTHONPATH=<before> and PYTHONPATH=<after>, one thread each
    python benchmarks/bench_real_size.py --models mamba1-130m --stages scan --n-prompts 16 \
        --scan-args="--force --threads 1"

``--extrapolate`` measures 1- and 2-layer cuts of Falcon-Mamba-7B's config (d_model 4096,
d_inner 8192) and of Zamba2-7B's two layer kinds (Mamba-2 layers; hybrid layers: a shared
transformer block application and a Mamba-2 layer), and extrapolates wall time and peak RSS to
the full models (64 layers; 68 + 13 layers), printed as a separate table labelled EXTRAPOLATED.

To add a model, add an entry to ``CONFIGS`` (a function returning a Hugging Face config); to add a
stage, add a function to ``STAGES``. ``PYTHONPATH=<other checkout>`` measures another version of
the package with the same script.
"""

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

KEYS = ("apple", "river", "stone", "cloud", "lamp", "tree", "house", "bird", "fish", "moon")


def mamba1_130m() -> Any:
    """``state-spaces/mamba-130m-hf``'s config."""
    from transformers import MambaConfig

    return MambaConfig(
        vocab_size=50280,
        hidden_size=768,
        num_hidden_layers=24,
        state_size=16,
        expand=2,
        conv_kernel=4,
        time_step_rank=48,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def mamba2_130m() -> Any:
    """``state-spaces/mamba2-130m``'s config (mamba_ssm format), as transformers writes it."""
    from transformers import Mamba2Config

    return Mamba2Config(
        vocab_size=50288,
        hidden_size=768,
        num_hidden_layers=24,
        num_heads=24,
        head_dim=64,
        expand=2,
        n_groups=1,
        state_size=128,
        conv_kernel=4,
        chunk_size=256,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def falcon_mamba_7b(n_layers: int) -> Callable[[], Any]:
    """``tiiuae/falcon-mamba-7b``'s config (64 layers, d_model 4096, d_inner 8192, d_state 16,
    dt_rank 256, vocab 65024) cut to ``n_layers`` layers, for extrapolation."""

    def config() -> Any:
        from transformers import FalconMambaConfig

        return FalconMambaConfig(
            vocab_size=65024,
            hidden_size=4096,
            num_hidden_layers=n_layers,
            state_size=16,
            expand=2,
            conv_kernel=4,
            time_step_rank=256,
            use_bias=False,
            use_conv_bias=True,
            residual_in_fp32=True,
            tie_word_embeddings=False,
            mixer_rms_eps=1e-6,
            bos_token_id=0,
            eos_token_id=11,
            pad_token_id=0,
        )

    return config


def zamba2_7b_size(kind: str, n_layers: int) -> Callable[[], Any]:
    """Zamba2-7B's sizes as a ``Zamba2Config`` of ``n_layers`` layers of one kind.

    The sizes of Zamba2-7B as published (d_model 3584, 81 layers of which 13 are hybrid, vocab
    32000; Mamba-2 layers of 112 heads of 64, d_state 64, 2 groups; 2 shared transformer blocks,
    32 heads over [hidden, embeddings] (224 dims per head), gated MLP 14336, LoRA adapters of
    rank 128 per application, RoPE in the shared attention), written here from the model card's
    numbers, not read from the hub. ``kind="mamba"``: Mamba-2 layers only; ``kind="hybrid"``: a
    shared-block application, its adapters and projection, then the layer's Mamba-2 mixer. The
    extrapolation counts 68 of the first and 13 of the second. Shared weights are counted once
    per block in the full model but grow with every hybrid layer in the linear extrapolation of
    memory (an overestimate: the 13 applications share 2 blocks).
    """

    def config() -> Any:
        from transformers import Zamba2Config

        return Zamba2Config(
            vocab_size=32000,
            hidden_size=3584,
            num_hidden_layers=n_layers,
            layers_block_type=[kind] * n_layers,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=2,
            n_mamba_heads=112,
            chunk_size=256,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=32,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=128,
            use_mem_rope=True,
            max_position_embeddings=4096,
            hidden_act="gelu",
            use_mamba_kernels=False,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )

    return config


CONFIGS: dict[str, Callable[[], Any]] = {
    "mamba1-130m": mamba1_130m,
    "mamba2-130m": mamba2_130m,
    "falcon-mamba-7b-L1": falcon_mamba_7b(1),
    "falcon-mamba-7b-L2": falcon_mamba_7b(2),
    "zamba2-7b-mamba-L1": zamba2_7b_size("mamba", 1),
    "zamba2-7b-mamba-L2": zamba2_7b_size("mamba", 2),
    "zamba2-7b-hybrid-L1": zamba2_7b_size("hybrid", 1),
    "zamba2-7b-hybrid-L2": zamba2_7b_size("hybrid", 2),
}
#: Models measured by default (the Falcon-Mamba-7B cuts are for ``--extrapolate``).
DEFAULT_MODELS = ["mamba1-130m", "mamba2-130m"]
#: ``--extrapolate``: per full model, its layer kinds as (1-layer cut, 2-layer cut, how many).
EXTRAPOLATIONS: dict[str, list[tuple[str, str, int]]] = {
    "falcon-mamba-7b": [("falcon-mamba-7b-L1", "falcon-mamba-7b-L2", 64)],
    "zamba2-7b": [
        ("zamba2-7b-mamba-L1", "zamba2-7b-mamba-L2", 68),
        ("zamba2-7b-hybrid-L1", "zamba2-7b-hybrid-L2", 13),
    ],
}


def build(name: str) -> Any:
    """A random-weight HookedSSM of ``CONFIGS[name]`` (Mamba-style init of the SSM parameters)."""
    from gna_lens.models import HookedSSM, SSMConfig

    cfg = SSMConfig.from_hf_config(CONFIGS[name]())
    cfg.dtype, cfg.device = torch.float32, "cpu"
    torch.manual_seed(0)
    model = HookedSSM(cfg)
    with torch.no_grad():
        model.embed.weight.normal_(0, 0.02)
        for mixer in model.ssm_mixers().values():
            if mixer.channel_heads:  # Mamba-1: per-channel A and dt_proj
                n = mixer.A_log.shape[-1]
                mixer.A_log.copy_(torch.log(torch.arange(1, n + 1.0)).expand_as(mixer.A_log))
                bias = mixer.dt_proj.bias
            else:
                mixer.A_log.uniform_(0.0, math.log(16.0))
                bias = mixer.dt_bias
            dt = torch.exp(
                torch.rand(bias.shape) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
            )
            bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    return model.eval()


def task(n_prompts: int) -> Any:
    from gna_lens.tasks import kv_retrieval
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    tok = word_tokenizer(
        ["Memorize the following dictionary:", "The value of the key '", " is", *KEYS]
    )
    return kv_retrieval(tok, n_pairs=8, n_samples=n_prompts, words=KEYS, seed=0)


def stage_forward(model: Any, t: Any) -> dict[str, Any]:
    ids = torch.tensor([s.input_ids for s in t])
    with torch.no_grad():
        model(ids)
    return {}


def stage_pattern_scores(model: Any, t: Any) -> dict[str, Any]:
    from gna_lens.scoring import pattern_scores

    scores = pattern_scores(model, t, progress=False)
    return {"heads": len(scores.heads)}


def stage_attribute_heads(model: Any, t: Any) -> dict[str, Any]:
    from gna_lens.interventions import attribute_heads

    res = attribute_heads(model, t)
    return {"heads": len(res.cells), "gradient_path": res.info.get("paths", {}).get("gradient")}


STAGES: dict[str, Callable[[Any, Any], dict[str, Any]]] = {
    "forward": stage_forward,
    "pattern_scores": stage_pattern_scores,
    "attribute_heads": stage_attribute_heads,
}
#: Stages that run the real ``gna-lens scan`` on a checkpoint written to disk (not a HookedSSM
#: built in this process): see :func:`run_scan`.
CLI_STAGES = ("scan",)


def scan_tokenizer() -> Any:
    """A word-level tokenizer covering what ``gna-lens scan --task kv`` feeds a model: both KV
    templates, the shipped word list (values), numbers 0-99 and the shipped prose (the control).

    Real checkpoints use BPE tokenizers (GPT-NeoX for mamba-130m): prompt lengths in tokens are
    close (one token per word here; the KV values must be single tokens there too), the control
    windows are the same length in tokens (8 windows of 48).
    """
    from gna_lens.tasks import load_prose, load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    texts = [
        "Below is a list of key-value pairs.\nkey: value\nWhat is the value for key X?\nX:",
        "Memorize the following dictionary:\nThe value of the key 'X' is",
        " ".join(load_words()),
        load_prose(),
    ]
    return word_tokenizer(texts)


def write_checkpoint(model_name: str, path: str) -> dict[str, Any]:
    """Write a random-weight Hugging Face checkpoint of ``CONFIGS[model_name]`` and
    :func:`scan_tokenizer` to ``path`` (``save_pretrained``, safetensors)."""
    from transformers import AutoModelForCausalLM

    tok = scan_tokenizer()
    config = CONFIGS[model_name]()
    if len(tok) > config.vocab_size:
        raise SystemExit(f"{model_name}: tokenizer {len(tok)} > vocab {config.vocab_size}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # transformers' own Mamba init (A, dt)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 0.02)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    return {"params": n_params, "tokenizer_vocab": len(tok)}


def _scan_lengths(ckpt: str, n_prompts: int) -> dict[str, Any]:
    """Token counts of the prompt sets ``gna-lens scan --task kv`` builds (its defaults: 48
    held-out prompts per task, 8 control windows of 48 tokens), for the cost model."""
    from transformers import AutoTokenizer

    from gna_lens.scan import build_tasks

    sets = build_tasks(AutoTokenizer.from_pretrained(ckpt), "kv", n_samples=n_prompts, seed=0)
    return {
        "selection": [s.n_tokens for s in sets.selection],
        "held_out": {k: [s.n_tokens for s in v] for k, v in sets.held_out.items()},
        "control": [8, 48],
    }


def _ranked(report: dict[str, Any], k: int = 10) -> list[list[int]]:
    """The ``k`` heads with the most negative measured ablation effect (raw order)."""
    rows = [h for h in report["heads"] if h["ablation_effect"] is not None]
    rows.sort(key=lambda h: h["ablation_effect"])
    return [[h["layer"], h["head"]] for h in rows[:k]]


def run_scan(model_name: str, n_prompts: int, scan_args: list[str]) -> dict[str, Any]:
    """Write the checkpoint, then run ``python -m gna_lens.cli scan <dir> --task kv --n-samples
    n_prompts`` plus ``scan_args`` (none: the CLI's defaults) as a child process; its wall time,
    its peak RSS (``RUSAGE_CHILDREN``: the child alone, the checkpoint writer is this process)
    and the stage timings from its ``report.json``."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, model_name)
        info = write_checkpoint(model_name, ckpt)
        out = os.path.join(tmp, "report")
        cmd = [sys.executable, "-m", "gna_lens.cli", "scan", ckpt, "--task", "kv"]
        cmd += ["--n-samples", str(n_prompts), "--out", out, *scan_args]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        load_after = os.getloadavg()
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if proc.returncode:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise SystemExit(f"scan exited {proc.returncode}: {tail}")
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        lengths = _scan_lengths(ckpt, n_prompts)
    threads = re.search(r"\((\d+) torch thread\(s\)[^)]*\)", proc.stderr)
    method = report["method"]
    return {
        "model": model_name,
        "stage": "scan",
        "seconds": seconds,
        "peak_rss_mib": peak,
        "rss_after_build_mib": float("nan"),
        "n_prompts": n_prompts,
        "command": " ".join(["gna-lens", *cmd[3:]]),
        "threads": threads.group(0) if threads else "?",
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "timings": report.get("timings", {}),
        "strategy": method.get("strategy"),
        "n_exact": report.get("n_exact"),
        "n_heads": len(report["heads"]),
        "head_groups": method.get("head_groups", ""),
        "sweep_dtype": method.get("sweep_dtype"),
        "top": report.get("top"),
        "layer_heads": report["layer_heads"],
        "layer_ranking": [r["layer"] for r in report.get("layer_ranking", [])],
        "scanned_layers": [r["layer"] for r in report.get("layer_ranking", []) if r["scanned"]],
        "ranked_heads": _ranked(report),
        "sweep_dtype_choice": method.get("sweep_dtype_choice", ""),
        "lengths": lengths,
        "random_draws": report["held_out"]["method"].get("random_draws"),
        "timings_heads": report.get("timings_heads", {}),
        "stdout_tail": proc.stdout.strip().splitlines()[-1:],
        **info,
    }


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(model_name: str, stage: str, n_prompts: int, threads: int) -> dict[str, Any]:
    """Measure one stage in this process (called in a subprocess by :func:`main`)."""
    torch.set_num_threads(threads)
    model = build(model_name)
    t = task(n_prompts)
    rss_model = _rss_mib()
    t0 = time.perf_counter()
    extra = STAGES[stage](model, t)
    seconds = time.perf_counter() - t0
    return {
        "model": model_name,
        "stage": stage,
        "seconds": seconds,
        "peak_rss_mib": _rss_mib(),
        "rss_after_build_mib": rss_model,
        "prompt_tokens": t[0].n_tokens,
        "n_prompts": len(t),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(CONFIGS))
    parser.add_argument(
        "--extrapolate",
        action="store_true",
        help="also measure 1- and 2-layer cuts of Falcon-Mamba-7B and Zamba2-7B and extrapolate "
        "to the full models",
    )
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=[*STAGES, *CLI_STAGES])
    parser.add_argument(
        "--scan-args",
        default="",
        help="scan stage: more arguments for gna-lens scan, one string (default none: the "
        "CLI's defaults, threads included)",
    )
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on 2 shared cores, 2 threads ran a forward 6x slower)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per stage")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "STAGE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        if args.one[1] in CLI_STAGES:
            print(json.dumps(run_scan(args.one[0], args.n_prompts, args.scan_args.split())))
        else:
            print(json.dumps(run_one(*args.one, args.n_prompts, args.threads)))
        return
    import gna_lens

    rows = []
    models = list(args.models)
    if args.extrapolate:
        cuts = [m for kinds in EXTRAPOLATIONS.values() for cut in kinds for m in cut[:2]]
        models += [m for m in cuts if m not in models]
    for name in models:
        for stage in args.stages:
            cmd = [sys.executable, __file__, "--one", name, stage]
            cmd += ["--n-prompts", str(args.n_prompts), "--threads", str(args.threads)]
            cmd += [f"--scan-args={args.scan_args}"]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ)
                )
            except subprocess.TimeoutExpired:
                rows.append(
                    {
                        "model": name,
                        "stage": stage,
                        "error": f"not finished in {args.timeout:.0f} s",
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
                continue
            if proc.returncode < 0:  # killed by a signal: SIGKILL is usually the OOM killer
                took = time.perf_counter() - t0
                why = f"killed by signal {-proc.returncode} after {took:.0f} s"
                if proc.returncode == -9:
                    why += " (SIGKILL: out of memory? see dmesg)"
                rows.append({"model": name, "stage": stage, "error": why})
            elif proc.returncode:
                err = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                rows.append({"model": name, "stage": stage, "error": err[0]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            rows[-1]["wall_s"] = time.perf_counter() - t0
            print(rows[-1], file=sys.stderr, flush=True)
    print(
        f"gna_lens from {os.path.dirname(gna_lens.__file__)}; machine {platform.machine()}, "
        f"{os.cpu_count()} cores, {args.threads} torch threads, torch {torch.__version__}\n"
    )
    print("| model | stage | time (s) | peak RSS (MiB) | RSS after building the model (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['stage']} | {r['error']} | - | - |")
        else:
            print(
                f"| {r['model']} | {r['stage']} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
                f"{r['rss_after_build_mib']:.0f} |"
            )
    if args.extrapolate:
        print(extrapolation_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def extrapolation_table(rows: list[dict[str, Any]]) -> str:
    """EXTRAPOLATED full-model numbers from 1- and 2-layer cuts (same prompts, same machine).

    Per layer kind: ``per_layer = t(L2) - t(L1)``; the fixed part (embedding, unembedding, task
    set-up) is ``t(L1) - per_layer`` of the first kind; the full model is ``fixed + sum(n_kind *
    per_layer_kind)``. Peak RSS the same way, which assumes memory grows by the same amount with
    every layer: true of the weights (and of attribution's saved activations), an overestimate
    for pattern_scores, which holds one layer's pattern at a time. Every cut runs with fp32
    weights on the CPU.
    """
    by = {(r["model"], r["stage"]): r for r in rows if "error" not in r}
    out = [
        "\nEXTRAPOLATED (not measured): full models from 1- and 2-layer cuts\n",
        "| model | stage | per layer (s) | extrapolated time | per layer (MiB) | "
        "extrapolated peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for full, kinds in EXTRAPOLATIONS.items():
        n_total = sum(n for _, _, n in kinds)
        for stage in STAGES:
            pairs = [(by.get((one, stage)), by.get((two, stage)), n) for one, two, n in kinds]
            if any(a is None or b is None for a, b, _ in pairs):
                continue
            dts = [b["seconds"] - a["seconds"] for a, b, _ in pairs]  # type: ignore[index]
            dms = [b["peak_rss_mib"] - a["peak_rss_mib"] for a, b, _ in pairs]  # type: ignore[index]
            first = pairs[0][0]
            assert first is not None
            t = (
                first["seconds"]
                - dts[0]
                + sum(n * d for (_, _, n), d in zip(pairs, dts, strict=True))
            )
            m = (
                first["peak_rss_mib"]
                - dms[0]
                + sum(n * d for (_, _, n), d in zip(pairs, dms, strict=True))
            )
            per_t = " / ".join(f"{d:.2f}" for d in dts)
            per_m = " / ".join(f"{d:.0f}" for d in dms)
            out.append(
                f"| {full} ({n_total} layers) | {stage} | {per_t} | {t / 60:.1f} min | "
                f"{per_m} | {m / 1024:.1f} GiB |"
            )
    return "\n".join(out)


if __name__ == "__main__":
    main()
