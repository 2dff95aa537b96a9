"""GPU acceptance benchmark: one process, about 5 minutes on one H100, JSON out.

Sections, in order of importance (each one a dict in the JSON with its numbers, the config it
used, its wall time and ``"pass"``: true / false against its acceptance line, null where not
judged; a section that raises records the error and the run goes on):

1. ``agreement``: :func:`gna_lens.score_heads` (every head exact, float32 sweeps) on the zoo models
   ``zoo-mamba2`` and ``zoo-llama``, on the CPU and on the device, same task (the zoo's ``kv-8``,
   16 prompts) and control (the zoo's cloze control, 32 prompts). Acceptance: the same top 4,
   every effect within 1e-3.
2. ``forward``: HookedSSM's fast path vs transformers' own ``Mamba2ForCausalLM`` /
   ``MambaForCausalLM`` on the same random weights (mamba2-130m and mamba-130m configs), batch
   8 x 1024, float32: median times, ratio, largest logit difference; with gna_lens's kernels on
   and forced off where ``gna_lens.models.kernels`` allows it (the path that ran is recorded).
   Goal (benchmarks/RESULTS.md): ratio <= 1.0 on the default path; logits within 1e-3 x the
   largest logit on the reference path (random real-size weights in float32 are 1e-4 relative
   from float64 on the CPU already: 1.6e-3 absolute of 15.6 at 1 x 1024 on mamba2-130m).
3. ``materialize``: every Mamba-2 layer's ``hook_pattern`` hooked (a hook that returns nothing)
   vs the fast path, mamba2-130m, 8 x 1024: time ratio and peak memory above the fast path's.
   Acceptance: at most 4 GiB above the fast path.
4. ``exact_scans``: ``score_heads(strategy="exact", control="prose", sweep_dtype="auto")`` on
   16 KV prompts, on random-weight models of real shapes, in this order: mamba2-1.3b (3072
   heads, float32), Llama-3.1-8B (1024 heads, bfloat16), mamba2-130m (576 heads, float32),
   Llama-3.2-1B (512 heads, bfloat16). Each is written with ``save_pretrained`` (bfloat16, with
   a word-level tokenizer covering the KV templates and the shipped prose) and loaded with
   ``load_model(dir, device=..., dtype=...)``, a user's path; the 8B shape is built on the
   device and booted with ``TransformerBridge.boot_transformers(hf_model=...)`` instead (a 16 GB
   checkpoint write would take the run's time), which the JSON says. Records seconds, heads,
   peak memory, ``method["strategy_choice"]`` and what ``strategy="auto"`` would choose.
   Acceptance: mamba2-1.3b <= 120 s, Llama-3.1-8B shape <= 300 s.
5. ``distill``: ``build_hybrid`` + ``distill`` on a Llama-3.2-1B-shaped random teacher (4 heads
   kept), batch 16 x 512, bfloat16 autocast, d_state 64, a 40 s time budget (half per stage):
   tokens/s per stage, peak memory. Acceptance: stage 1 >= 30,000 and stage 2 >= 20,000 tokens/s.

The JSON also holds the machine, versions, whether ``mamba_ssm`` / ``causal_conv1d`` are
installed, the date, the command line and each section's wall time; it is rewritten after every
section, so a run that is killed keeps what it finished. Sections start only before
``--deadline`` seconds have passed (default 280); the exact scans check it before each model,
keeping the distillation's budget + 40 s for it; what did not start is recorded as
``"skipped: deadline"``. The exact scans at their acceptance limits (120 s + 300 s) do not fit
in one 5-minute run with the rest: the 8B scan runs on its own (below).

``--tiny``: every section on tiny configs (2 layers, batch 2 x 128, 8 prompts) on ``--device``,
the same code paths in a few seconds to a minute on a CPU; numbers are meaningless and ``pass``
is null (acceptance lines recorded, not judged). ``tests/test_bench_gpu.py`` runs it.

On the GPU machine (its image has torch, numpy, accelerate, safetensors, tokenizers, ... but not
transformer-lens, transformers 5.23 and a few more). First, on a machine with a registry, from
the project root (downloads the wheels into ``.whl/``, which git ignores: send it along with the
checkout)::

    bash ../shared/gpu/prepare_wheels.sh

Then on the GPU machine, from the project root::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 || exit
    # about 5 min: every section, the exact scans but the 8B one
    python3 benchmarks/bench_gpu.py --scan-models mamba2-1.3b,mamba2-130m,llama-3.2-1b \\
        --out bench_gpu.json
    # the 8B scan alone (up to its 300 s acceptance, plus building the model)
    python3 benchmarks/bench_gpu.py --only exact_scans --scan-models llama-3.1-8b \\
        --out bench_gpu_8b.json

Other flags: ``--only SECTION[,SECTION]``, ``--skip SECTION[,SECTION]``, ``--repeats N`` (timed
runs per median, default 3), ``--distill-budget "40 s"``, ``--tmp DIR`` (where checkpoints are
written; default the system's temp dir), ``--threads N``. Without a GPU::

    python benchmarks/bench_gpu.py --tiny --device cpu --out /tmp/bench_gpu.json
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

SECTIONS = ("agreement", "forward", "materialize", "exact_scans", "distill")
#: The exact scans' models, in order of importance: the two with acceptance lines first.
SCAN_MODELS = ("mamba2-1.3b", "llama-3.1-8b", "mamba2-130m", "llama-3.2-1b")
#: Per exact-scan model: its weights' dtype, how it is built (checkpoints are written in
#: bfloat16, half the disk time, and loaded in ``dtype``), and its acceptance line (seconds).
SCAN_SPECS: dict[str, dict[str, Any]] = {
    "mamba2-130m": {"dtype": "float32", "via": "load_model", "limit_s": None},
    "mamba2-1.3b": {"dtype": "float32", "via": "load_model", "limit_s": 120.0},
    "llama-3.2-1b": {"dtype": "bfloat16", "via": "load_model", "limit_s": None},
    "llama-3.1-8b": {"dtype": "bfloat16", "via": "device", "limit_s": 300.0},
}
ACCEPTANCE = {
    "agreement": "zoo-mamba2 and zoo-llama: the same top 4 on the CPU and the device, every "
    "effect within 1e-3",
    "forward": "goal (RESULTS.md): HookedSSM's default fast path no slower than Hugging Face's "
    "forward (ratio <= 1.0); on the reference path (kernels off) max |logit difference| <= "
    "1e-3 x max |logit| (float32 at these sizes: random real-size weights differ by 1e-4 "
    "relative from float64 already)",
    "materialize": "every Mamba-2 layer's pattern materialized (mamba2-130m, 8 x 1024): peak "
    "memory at most 4 GiB above the fast path",
    "exact_scans": "every head exact, 16 prompts, prose control: mamba2-1.3b (3072 heads) <= "
    "120 s; Llama-3.1-8B shape (1024 heads, bfloat16) <= 300 s",
    "distill": "Llama-3.2-1B-shaped teacher, 16 x 512, bfloat16 autocast, d_state 64: stage 1 "
    ">= 30,000 and stage 2 >= 20,000 tokens/s",
}
AGREEMENT_TOL = 1e-3
FORWARD_REL_TOL = 1e-3
MATERIALIZE_LIMIT_GIB = 4.0
DISTILL_MIN_TOKENS_S = {"stage1": 30_000.0, "stage2": 20_000.0}
GIB = 2**30


# ----------------------------------------------------------------------------- configs
def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def hf_config(name: str, tiny: bool, vocab: int | None = None, tok: Any = None) -> Any:
    """The Hugging Face config of ``name`` (real sizes, or tiny ones with ``tiny``).

    Real sizes, written from the published configs: mamba2-130m / mamba2-1.3b (state-spaces),
    mamba-130m (``state-spaces/mamba-130m-hf``), Llama-3.2-1B and Llama-3.1-8B (meta-llama).
    ``vocab`` replaces the vocabulary size (tiny models take the tokenizer's); ``tok`` gives the
    special token ids.
    """
    import transformers as tf

    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if tok is not None:
        ids = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
    if name.startswith("mamba2"):
        if tiny:
            kw: dict[str, Any] = dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_heads=4,
                head_dim=32,
                state_size=16,
                chunk_size=32,
                vocab_size=1000,
            )
        else:
            d, layers = (768, 24) if name == "mamba2-130m" else (2048, 48)
            kw = dict(
                hidden_size=d,
                num_hidden_layers=layers,
                num_heads=2 * d // 64,
                head_dim=64,
                state_size=128,
                chunk_size=256,
                vocab_size=50288,
            )
        kw |= dict(
            expand=2,
            n_groups=1,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            residual_in_fp32=True,
            tie_word_embeddings=True,
            use_cache=False,
        )
        cls: Any = tf.Mamba2Config
    elif name == "mamba-130m":
        if tiny:
            kw = dict(hidden_size=64, num_hidden_layers=2, time_step_rank=4, vocab_size=1000)
        else:
            kw = dict(hidden_size=768, num_hidden_layers=24, time_step_rank=48, vocab_size=50280)
        kw |= dict(
            state_size=16,
            expand=2,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            residual_in_fp32=True,
            tie_word_embeddings=True,
            use_cache=False,
        )
        cls = tf.MambaConfig
    elif name.startswith("llama"):
        small = name == "llama-3.2-1b"
        if tiny:
            kw = dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=128,
                vocab_size=1000,
            )
        elif small:
            kw = dict(
                hidden_size=2048,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                intermediate_size=8192,
                vocab_size=128256,
            )
        else:
            kw = dict(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=14336,
                vocab_size=128256,
            )
        kw |= dict(
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=small,
            rope_parameters=_llama3_rope(32.0 if small else 8.0),
            use_cache=False,
        )
        cls = tf.LlamaConfig
    else:
        raise ValueError(f"unknown model {name!r}")
    if vocab is not None:
        kw["vocab_size"] = vocab
    return cls(**(kw | ids))


def config_summary(config: Any) -> dict[str, Any]:
    """The sizes of a config, for the JSON."""
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_heads",
        "head_dim",
        "state_size",
        "n_groups",
        "chunk_size",
        "expand",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
    )
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def build_hf(config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight Hugging Face causal LM of ``config``, built on ``device`` (no host copy)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@functools.cache
def scan_tokenizer() -> Any:
    """A word-level tokenizer covering the KV templates, the shipped word list, numbers and the
    shipped prose (the control), as ``benchmarks/bench_real_size.py`` builds it (19,652 words;
    a real BPE tokenizer cuts prompts to about the same lengths)."""
    from gna_lens.tasks import load_prose, load_words
    from gna_lens.tasks.toy_tokenizers import word_tokenizer

    texts = [
        "Below is a list of key-value pairs.\nkey: value\nWhat is the value for key X?\nX:",
        "Memorize the following dictionary:\nThe value of the key 'X' is",
        " ".join(load_words()),
        load_prose(),
    ]
    return word_tokenizer(texts)


# ----------------------------------------------------------------------------- environment
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _kernels_module() -> Any:
    """:mod:`gna_lens.models.kernels`, or ``None`` in a gna_lens without it."""
    try:
        return importlib.import_module("gna_lens.models.kernels")
    except ModuleNotFoundError:
        return None


def kernels_state() -> dict[str, Any]:
    """Whether mamba_ssm / causal_conv1d are installed, and what ``gna_lens.models.kernels``
    says of them (``kernel_status()``: "not checked" until the first CUDA call)."""
    installed = {
        "mamba_ssm": importlib.util.find_spec("mamba_ssm") is not None,
        "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
    }
    info: dict[str, Any] = dict(installed)
    any_installed = any(installed.values())
    mod = _kernels_module()
    if mod is None:
        info["kernels"] = (
            "installed, but this gna_lens has no kernels module to use them"
            if any_installed
            else "not installed"
        )
        return info
    info["kernels"] = (
        "installed: " + ", ".join(k for k, v in installed.items() if v)
        if any_installed
        else "not installed"
    )
    info["enabled"] = mod.kernels_enabled()
    info["status"] = mod.kernel_status()
    return info


def kernel_switches() -> list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]]:
    """The gna_lens paths the forward section times: kernels on (where installed; the default)
    and forced off (``use_kernels(False)``: the pure-PyTorch reference)."""
    mod = _kernels_module()
    if mod is None:
        return [("default (no kernels module)", contextlib.nullcontext)]
    return [
        ("kernels on", lambda: mod.use_kernels(True)),
        ("kernels off", lambda: mod.use_kernels(False)),
    ]


def _pattern_budget() -> int | None:
    """The working-memory budget of pattern materialization (None without the kernels module)."""
    mod = _kernels_module()
    return None if mod is None else int(mod.current_pattern_budget())


def paths_taken(model: Any) -> Any:
    """The paths the model's mixers took in their last forward, counted:
    ``{"scan": {"torch.ssd": 24}, "conv": {"torch.conv1d": 24}}``."""
    mod = _kernels_module()
    if mod is None:
        return "not recorded (no gna_lens.models.kernels)"
    counts: dict[str, dict[str, int]] = {}
    for path in mod.kernel_paths(model).values():
        for kind, value in path.items():
            counts.setdefault(kind, {})
            counts[kind][value] = counts[kind].get(value, 0) + 1
    return counts


def machine(device: torch.device) -> dict[str, Any]:
    from gna_lens.device import DevicePolicy

    policy = DevicePolicy(device, torch.float32)
    out: dict[str, Any] = {
        "machine": policy.machine(),
        "device": str(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "transformer_lens": _version("transformer-lens"),
        "gna_lens": _version("gna-lens"),
        "torch_threads": torch.get_num_threads(),
        "tf32": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        },
    }
    if policy.is_cuda:
        props = torch.cuda.get_device_properties(device)
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
    with contextlib.suppress(Exception):
        here = Path(__file__).resolve().parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if commit.returncode == 0:
            out["commit"] = commit.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, str | int | bool) or x is None:
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return _jsonable(x.item())
    return str(x)


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Run:
    """What every section needs: the arguments, the device, the clock."""

    args: argparse.Namespace
    device: torch.device
    start: float

    @property
    def tiny(self) -> bool:
        return bool(self.args.tiny)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    #: Seconds kept for the sections still to run (set by main): the exact scans stop starting
    #: models early enough for the distillation after them.
    reserve: float = 0.0

    def past_deadline(self, reserve: float = 0.0) -> bool:
        return self.elapsed() >= self.args.deadline - reserve

    def judge(self, ok: bool | None) -> bool | None:
        """``ok`` on real configs; ``None`` (not judged) with ``--tiny``."""
        return None if self.tiny or ok is None else bool(ok)

    def policy(self, model: Any) -> Any:
        from gna_lens.device import DevicePolicy

        return DevicePolicy.of(model)

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        from gna_lens.device import DevicePolicy

        return DevicePolicy(self.device, torch.float32).peak_memory()

    def free(self) -> None:
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


def timed(run: Run, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` (synchronized on CUDA)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if run.is_cuda:
            torch.cuda.synchronize(run.device)
        t0 = time.perf_counter()
        fn()
        if run.is_cuda:
            torch.cuda.synchronize(run.device)
        out.append(time.perf_counter() - t0)
    return out


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def _finite_max_abs(a: torch.Tensor, b: torch.Tensor) -> float | None:
    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return None
    return float((a[both].double() - b[both].double()).abs().max())


# ----------------------------------------------------------------------------- 1. agreement
def section_agreement(run: Run) -> dict[str, Any]:
    from gna_lens import load_model, zoo
    from gna_lens.scoring import score_heads

    n_prompts, n_control = (8, 8) if run.tiny else (16, 32)
    out: dict[str, Any] = {
        "config": {
            "models": ["zoo-mamba2", "zoo-llama"],
            "task": f"zoo kv-8, first {n_prompts} prompts",
            "control": f"zoo cloze control (select split), first {n_control} prompts",
            "strategy": "exact",
            "sweep_dtype": "float32 (the models' own)",
            "where": ["cpu", str(run.device)],
            "tolerance": AGREEMENT_TOL,
        },
        "models": {},
    }
    verdicts = []
    # One tokenizer for every zoo model, so one set of tasks.
    task = zoo.tasks()["kv-8"][:n_prompts]
    control = dataclasses.replace(
        zoo.control()[:n_control], name=f"cloze-select (first {n_control} prompts)"
    )
    for name in ("zoo-mamba2", "zoo-llama"):
        reports = {}
        seconds = {}
        for label, where in (("cpu", "cpu"), ("device", str(run.device))):
            model = load_model(name, device=where)
            t0 = time.perf_counter()
            reports[label] = score_heads(
                model, task, control=control, strategy="exact", sweep_dtype=None, progress=False
            )
            seconds[label] = time.perf_counter() - t0
            del model
            run.free()
        cpu, dev = reports["cpu"], reports["device"]
        top_cpu, top_dev = [list(h) for h in cpu.top(4)], [list(h) for h in dev.top(4)]
        diffs = {
            col: _finite_max_abs(cpu.scores[col], dev.scores[col])
            for col in ("ablation_effect", "control_effect")
        }
        worst = max((d for d in diffs.values() if d is not None), default=None)
        same_top = sorted(map(tuple, top_cpu)) == sorted(map(tuple, top_dev))
        ok = same_top and worst is not None and worst <= AGREEMENT_TOL
        verdicts.append(ok)
        out["models"][name] = {
            "heads": len(cpu.heads),
            "top4_cpu": top_cpu,
            "top4_device": top_dev,
            "same_top4": same_top,
            "same_top4_order": top_cpu == top_dev,
            "max_abs_effect_diff": diffs,
            "max_abs_diff": worst,
            "seconds": seconds,
            "sweep_dtype": dev.method.get("sweep_dtype"),
            "pass": run.judge(ok),
        }
    out["pass"] = run.judge(all(verdicts))
    return out


# ----------------------------------------------------------------------------- 2. forward
def _forward_one(run: Run, name: str, b: int, length: int) -> dict[str, Any]:
    """One model of the forward section: HF and HookedSSM on the same weights and tokens."""
    from gna_lens.device import exact_matmul
    from gna_lens.models import HookedSSM

    config = hf_config(name, run.tiny)
    hf = build_hf(config, run.device, torch.float32)
    ours = HookedSSM.from_hf_model(hf)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size, (b, length), generator=gen).to(run.device)
    row: dict[str, Any] = {"config": config_summary(config), "paths": {}}

    def hf_forward() -> torch.Tensor:
        return hf(input_ids=ids, use_cache=False).logits

    def our_forward() -> torch.Tensor:
        return ours(ids)

    with torch.no_grad(), exact_matmul():
        hf_logits = hf_forward()
        row["hf_max_abs_logit"] = scale = float(hf_logits.abs().max())
        hf_times = timed(run, hf_forward, run.args.repeats, warmup=0)  # warmed up above
        row["hf_seconds"] = statistics.median(hf_times)
        row["hf_times"] = hf_times
        for label, switch in kernel_switches():
            with switch():
                diff = float((our_forward() - hf_logits).abs().max())
                path = paths_taken(ours)
                times = timed(run, our_forward, run.args.repeats, warmup=0)
            med = statistics.median(times)
            row["paths"][label] = {
                "seconds": med,
                "times": times,
                "ratio_vs_hf": med / row["hf_seconds"],
                "max_abs_logit_diff": diff,
                "relative_logit_diff": diff / scale if scale else None,
                "path": path,
            }
    return row


def section_forward(run: Run) -> dict[str, Any]:
    b, length = (2, 128) if run.tiny else (8, 1024)
    out: dict[str, Any] = {
        "config": {
            "batch": b,
            "length": length,
            "dtype": "float32",
            "weights": "random (transformers' init), built on the device",
            "repeats": run.args.repeats,
            "tf32": "off (exact_matmul) for both sides",
            "hf_path": "transformers' own (its mamba_ssm / causal_conv1d kernels where installed, "
            "else its PyTorch path)",
        },
        "kernels": kernels_state(),
        "models": {},
    }
    for name in ("mamba2-130m", "mamba-130m"):
        out["models"][name] = _forward_one(run, name, b, length)
        run.free()
    # Speed on the default path (kernels where installed); parity on the reference path (the
    # kernels' TF32 products move logits by about 1e-3 relative: gna_lens.models.kernels).
    ok = True
    for row in out["models"].values():
        paths = list(row["paths"].values())
        rel = paths[-1]["relative_logit_diff"]
        ok &= paths[0]["ratio_vs_hf"] <= 1.0 and rel is not None and rel <= FORWARD_REL_TOL
    out["pass"] = run.judge(ok)
    out["kernels_after"] = kernels_state()  # kernel_status() once a CUDA call looked them up
    return out


# ----------------------------------------------------------------------------- 3. materialize
def section_materialize(run: Run) -> dict[str, Any]:
    from gna_lens.device import exact_matmul
    from gna_lens.models import HookedSSM

    b, length = (2, 128) if run.tiny else (8, 1024)
    config = hf_config("mamba2-130m", run.tiny)
    hf = build_hf(config, run.device, torch.float32)
    model = HookedSSM.from_hf_model(hf)
    del hf
    run.free()
    names = [m.hook_pattern.name for m in model.ssm_mixers().values()]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size, (b, length), generator=gen).to(run.device)

    def noop(x: torch.Tensor, hook: Any) -> None:
        return None

    def fast() -> torch.Tensor:
        return model(ids)[:, -1]

    def materialized() -> torch.Tensor:
        with model.hooks(fwd_hooks=[(n, noop) for n in names]):
            return model(ids)[:, -1]

    with torch.no_grad(), exact_matmul():
        last_fast, last_mat = fast(), materialized()  # warm-up, and the two paths' difference
        diff = float((last_fast - last_mat).abs().max())
        del last_fast, last_mat
        run.free()
        peaks, paths = {}, {}
        for label, fn in (("fast", fast), ("materialized", materialized)):
            run.reset_peak()
            fn()
            peaks[label] = run.peak()
            paths[label] = paths_taken(model)
        t_fast = timed(run, fast, run.args.repeats, warmup=0)
        t_mat = timed(run, materialized, run.args.repeats, warmup=0)
    above = None if peaks["fast"] is None else peaks["materialized"] - peaks["fast"]
    pattern_bytes = b * config.num_heads * length * length * 4
    out = {
        "config": {
            "model": "mamba2-130m" + (" (tiny)" if run.tiny else ""),
            "model_config": config_summary(config),
            "batch": b,
            "length": length,
            "layers_hooked": len(names),
            "hook": "hook_pattern of every Mamba-2 layer, a hook returning None",
            "repeats": run.args.repeats,
            "one_layer_pattern_gib": round(pattern_bytes / GIB, 3),
        },
        "fast_seconds": statistics.median(t_fast),
        "materialized_seconds": statistics.median(t_mat),
        "ratio": statistics.median(t_mat) / statistics.median(t_fast),
        "times": {"fast": t_fast, "materialized": t_mat},
        "peak_fast_gib": _gib(peaks["fast"]),
        "peak_materialized_gib": _gib(peaks["materialized"]),
        "peak_above_fast_gib": _gib(above),
        "peak_memory": "CUDA max_memory_allocated" if run.is_cuda else "not measured on the CPU",
        "max_abs_last_logit_diff": diff,
        "paths": paths,
        "pattern_budget_bytes": _pattern_budget(),
    }
    ok = None if above is None else above <= MATERIALIZE_LIMIT_GIB * GIB
    out["pass"] = run.judge(ok)
    return out


# ----------------------------------------------------------------------------- 4. exact scans
@contextlib.contextmanager
def _quiet_saving() -> Iterator[None]:
    """No "Writing model shards" progress bar (restored after)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _scan_model(run: Run, name: str, record: dict[str, Any]) -> Iterator[Any]:
    """The model of an exact scan, on the device, as a user's checkpoint would load (or built
    there directly, for the 8B shape); ``record`` gets how and how long."""
    from gna_lens import load_model
    from gna_lens.device import resolve_dtype

    spec = SCAN_SPECS[name]
    tok = scan_tokenizer()
    dtype = resolve_dtype(spec["dtype"])
    assert dtype is not None
    config = hf_config(name, run.tiny, vocab=len(tok) if run.tiny else None, tok=tok)
    if len(tok) > config.vocab_size:
        raise ValueError(f"{name}: tokenizer {len(tok)} > vocab {config.vocab_size}")
    record["config"] = config_summary(config)
    record["dtype"] = spec["dtype"]
    t0 = time.perf_counter()
    if spec["via"] == "device":
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import AutoTokenizer

        hf = build_hf(config, run.device, dtype)
        with tempfile.TemporaryDirectory(dir=run.args.tmp, prefix="bench_tok_") as folder:
            # TransformerLens re-reads a tokenizer by its name_or_path: one loaded from a folder
            # (a tokenizer built in memory raises KeyError 'name_or_path' in boot_transformers).
            tok.save_pretrained(folder)
            model = TransformerBridge.boot_transformers(
                f"bench/{name}-shape",
                hf_model=hf,
                tokenizer=AutoTokenizer.from_pretrained(folder),
                device=str(run.device),
                dtype=dtype,
            )
        record["built"] = (
            "random weights built on the device, TransformerBridge.boot_transformers(hf_model=...)"
            " (not load_model: no checkpoint written)"
        )
        record["build_seconds"] = time.perf_counter() - t0
        try:
            yield model
        finally:
            del model, hf
            run.free()
        return
    with tempfile.TemporaryDirectory(dir=run.args.tmp, prefix=f"bench_{name}_") as folder:
        hf = build_hf(config, run.device, torch.bfloat16)
        with _quiet_saving():
            hf.save_pretrained(folder)
        tok.save_pretrained(folder)
        del hf
        run.free()
        record["build_seconds"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        model = load_model(folder, device=str(run.device), dtype=dtype)
        record["load_seconds"] = time.perf_counter() - t1
        record["built"] = (
            "random weights saved (bfloat16, save_pretrained, with the tokenizer) and loaded "
            f"with load_model(folder, device=..., dtype={spec['dtype']})"
        )
        try:
            yield model
        finally:
            del model
            run.free()


def section_exact_scans(run: Run) -> dict[str, Any]:
    from gna_lens.scoring import score_heads
    from gna_lens.sweep_policy import EXACT_BUDGET_S, choose_strategy
    from gna_lens.tasks import kv_retrieval

    n_prompts = 8 if run.tiny else 16
    models = run.args.scan_models
    out: dict[str, Any] = {
        "config": {
            "models": models,
            "task": f"kv_retrieval, 8 pairs, {n_prompts} prompts, seed 0 (word-level tokenizer "
            f"of {len(scan_tokenizer())} words)",
            "control": "prose (8 windows of 48 tokens)",
            "strategy": "exact",
            "sweep_dtype": "auto",
            "exact_budget_s": EXACT_BUDGET_S,
        },
        "models": {},
    }
    for name in models:
        spec = SCAN_SPECS[name]
        if run.past_deadline(run.reserve):
            out["models"][name] = {"skipped": "deadline", "pass": None}
            print(f"    exact scan {name}: skipped (deadline)", flush=True)
            continue
        row: dict[str, Any] = {"limit_s": spec["limit_s"]}
        out["models"][name] = row
        t_model = time.perf_counter()
        try:
            with _scan_model(run, name, row) as model:
                task = kv_retrieval(model.tokenizer, n_pairs=8, n_samples=n_prompts, seed=0)
                row["prompt_tokens"] = task[0].n_tokens
                row["params"] = sum(p.numel() for p in model.parameters())
                t0 = time.perf_counter()
                auto = choose_strategy(model, task, "auto")
                row["auto_choice"] = {
                    "strategy": auto[0],
                    "why": auto[1],
                    "seconds": time.perf_counter() - t0,
                }
                run.reset_peak()
                t0 = time.perf_counter()
                report = score_heads(
                    model,
                    task,
                    control="prose",
                    strategy="exact",
                    sweep_dtype="auto",
                    progress=False,
                )
                seconds = time.perf_counter() - t0
                method = report.method
                row.update(
                    seconds=seconds,
                    heads=len(report.heads),
                    n_exact=method.get("n_exact"),
                    peak_gib=_gib(run.peak()),
                    strategy_choice=method.get("strategy_choice"),
                    sweep_dtype=method.get("sweep_dtype"),
                    sweep_dtype_choice=method.get("sweep_dtype_choice"),
                    ablation_path=_jsonable(method.get("ablation_path")),
                    fallbacks=_jsonable(method.get("fallbacks")),
                    timings=_jsonable(report.timings),
                    top4=[list(h) for h in report.top(4)],
                )
                ok = None if spec["limit_s"] is None else seconds <= spec["limit_s"]
                row["pass"] = run.judge(ok)
        except Exception as err:  # one model's failure does not stop the others
            row.update(_error(err))
            row["pass"] = run.judge(False) if spec["limit_s"] is not None else None
        run.free()
        row["wall_s"] = time.perf_counter() - t_model
        print(f"    exact scan {name}: {_row_line(row)}", flush=True)
    limits = [n for n in models if SCAN_SPECS[n]["limit_s"] is not None]
    results = [out["models"][n].get("pass") for n in limits]
    if run.tiny or not limits:
        out["pass"] = None
    elif any(r is False for r in results):
        out["pass"] = False
    elif all(r is True for r in results) and {"mamba2-1.3b", "llama-3.1-8b"} <= set(limits):
        out["pass"] = True
    else:
        out["pass"] = None  # an acceptance model not run here: split runs are judged together
    return out


def _row_line(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    if "error" in row:
        return f"ERROR {row['error']}"
    return (
        f"{row.get('heads')} heads in {row.get('seconds', float('nan')):.1f} s "
        f"(load {row.get('load_seconds', 0.0):.1f} s, build {row.get('build_seconds', 0.0):.1f} s)"
        f", peak {row.get('peak_gib')} GiB, sweep {row.get('sweep_dtype')}, pass {row.get('pass')}"
    )


# ----------------------------------------------------------------------------- 5. distill
def section_distill(run: Run) -> dict[str, Any]:
    from gna_lens.hybrid import build_hybrid, distill

    tok = scan_tokenizer()
    if run.tiny:
        batch, length, d_state, budget = 2, 32, 8, 4 * 2 * 32  # two steps per stage
    else:
        batch, length, d_state, budget = 16, 512, 64, run.args.distill_budget
    config = hf_config("llama-3.2-1b", run.tiny, vocab=len(tok) if run.tiny else None, tok=tok)
    teacher = build_hf(config, run.device, torch.float32)
    keep = [(layer, 0) for layer in range(0, config.num_hidden_layers, 4)]
    student = build_hybrid(teacher, keep, d_state=d_state, tokenizer=tok)
    # Texts longer than max_length (one word is one token), so every batch is full.
    words = [w for w in tok.get_vocab() if w.startswith(" ") and w[1:].isalpha()]
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(length + 32)) for _ in range(64)]
    run.free()
    run.reset_peak()
    t0 = time.perf_counter()
    result = distill(
        student,
        teacher,
        itertools.cycle(texts),
        budget=budget,
        stage1_share=0.5,
        batch_size=batch,
        max_length=length,
        autocast="bfloat16",
        progress=False,
    )
    seconds = time.perf_counter() - t0
    peak = run.peak()
    rates = {
        stage: t["tokens"] / t["seconds"] if t["seconds"] else None
        for stage, t in result.totals.items()
    }
    ok = all(
        rates.get(stage) is not None and rates[stage] >= floor  # type: ignore[operator]
        for stage, floor in DISTILL_MIN_TOKENS_S.items()
    )
    out = {
        "config": {
            "teacher": "llama-3.2-1b shape" + (" (tiny)" if run.tiny else "") + ", random weights",
            "teacher_config": config_summary(config),
            "kept_heads": [list(h) for h in keep],
            "batch": batch,
            "max_length": length,
            "d_state": d_state,
            "autocast": "bfloat16",
            "budget": result.budget.to_dict(),
            "stage1_share": 0.5,
            "data": f"{len(texts)} texts of {length + 32} random words, cycled (full batches)",
        },
        "tokens_per_s": rates,
        "totals": _jsonable(result.totals),
        "n_trained": result.n_trained,
        "probe": _jsonable(result.probe),
        "seconds": seconds,
        "peak_gib": _gib(peak),
        "floors_tokens_per_s": DISTILL_MIN_TOKENS_S,
        "pass": run.judge(ok),
    }
    return out


SECTION_FNS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "agreement": section_agreement,
    "forward": section_forward,
    "materialize": section_materialize,
    "exact_scans": section_exact_scans,
    "distill": section_distill,
}


# ----------------------------------------------------------------------------- main
def _error(err: BaseException) -> dict[str, Any]:
    tail = traceback.format_exception(type(err), err, err.__traceback__)
    lines = "".join(tail).strip().splitlines()
    return {"error": f"{type(err).__name__}: {err}"[:2000], "traceback": lines[-12:]}


def _reserve(section: str, args: argparse.Namespace) -> float:
    """Seconds a later section needs (the distillation: its budget plus building the models)."""
    if section != "distill" or args.tiny:
        return 0.0
    from gna_lens.hybrid import parse_budget

    budget = parse_budget(args.distill_budget)
    return (budget.seconds or 60.0) + 40.0


def _names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; expected some of {list(allowed)}")
    return names


def _summary(name: str, sec: dict[str, Any]) -> str:
    """One line of a section's numbers (a line that cannot be made does not stop the run)."""
    try:
        return _summary_line(name, sec)
    except (KeyError, TypeError, ValueError) as err:
        return f"(see the JSON; no summary line: {type(err).__name__}: {err})"


def _summary_line(name: str, sec: dict[str, Any]) -> str:
    if "skipped" in sec:
        return f"skipped ({sec['skipped']})"
    if "error" in sec:
        return f"ERROR {sec['error']}"
    if name == "agreement":
        parts = [
            f"{m}: top4 same {r['same_top4']}, max diff {r['max_abs_diff']}"
            for m, r in sec["models"].items()
        ]
    elif name == "forward":
        parts = [
            f"{m} {label}: ours {p['seconds']:.3f} s vs HF {r['hf_seconds']:.3f} s "
            f"({p['ratio_vs_hf']:.2f}x), logit diff {p['max_abs_logit_diff']:.1e} "
            f"({p['relative_logit_diff']:.1e} relative)"
            for m, r in sec["models"].items()
            for label, p in r["paths"].items()
        ]
    elif name == "materialize":
        parts = [
            f"{sec['materialized_seconds']:.3f} s vs {sec['fast_seconds']:.3f} s "
            f"({sec['ratio']:.2f}x), peak above fast {sec['peak_above_fast_gib']} GiB"
        ]
    elif name == "exact_scans":
        parts = [f"{m}: {_row_line(r)}" for m, r in sec["models"].items()]
    else:
        rates = sec["tokens_per_s"]
        parts = [f"{s} {v:,.0f} tok/s" if v else f"{s} -" for s, v in rates.items()]
        parts.append(f"peak {sec['peak_gib']} GiB")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="bench_gpu.json")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (tests, CPU)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--skip", default="", help="sections to skip, comma-separated")
    parser.add_argument(
        "--deadline",
        type=float,
        default=280.0,
        help="seconds after which no section (or exact-scan model) starts",
    )
    parser.add_argument("--scan-models", default=",".join(SCAN_MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per median")
    parser.add_argument("--distill-budget", default="40 s")
    parser.add_argument("--tmp", default=None, help="where checkpoints are written")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's; 1 with --tiny on the CPU)",
    )
    args = parser.parse_args(argv)
    only = _names(args.only, SECTIONS, "--only")
    skip = _names(args.skip, SECTIONS, "--skip")
    args.scan_models = _names(args.scan_models, SCAN_MODELS, "--scan-models")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from gna_lens.device import resolve_device

    device = resolve_device(args.device)
    threads_before = torch.get_num_threads()
    if args.threads or (args.tiny and device.type == "cpu"):
        torch.set_num_threads(args.threads or 1)
    run = Run(args, device, time.perf_counter())
    command = shlex.join(
        [
            sys.executable,
            sys.argv[0] if argv is None else __file__,
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    result: dict[str, Any] = {
        "benchmark": "benchmarks/bench_gpu.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "tiny": bool(args.tiny),
        "judged": not args.tiny,
        "deadline_s": args.deadline,
        "machine": machine(device),
        "kernels": kernels_state(),
        "acceptance": ACCEPTANCE,
        "sections_run": [],
    }
    out_path = Path(args.out)

    def write() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(_jsonable(result), indent=1) + "\n", encoding="utf-8")

    print(f"bench_gpu on {result['machine']['machine']}" + (" [tiny]" if args.tiny else ""))
    try:
        for name in SECTIONS:
            if name not in only or name in skip:
                result[name] = {"skipped": "not selected (--only / --skip)", "pass": None}
                continue
            if run.past_deadline():
                result[name] = {"skipped": "deadline", "pass": None}
                print(f"[{name}] skipped: deadline ({run.elapsed():.0f} s >= {args.deadline:g} s)")
                continue
            later = [s for s in SECTIONS[SECTIONS.index(name) + 1 :] if s in only and s not in skip]
            run.reserve = sum(_reserve(s, args) for s in later)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    sec = SECTION_FNS[name](run)
                except Exception as err:
                    sec = _error(err) | {"pass": run.judge(False)}
            run.free()
            sec["acceptance"] = ACCEPTANCE[name]
            sec["wall_s"] = time.perf_counter() - t0
            seen = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
            if seen:
                sec["warnings"] = [s[:300] for s in seen[:8]]
            result[name] = sec
            result["sections_run"].append(name)
            result["total_s"] = run.elapsed()
            write()
            print(
                f"[{name}] {sec['wall_s']:.1f} s (total {run.elapsed():.1f} s): pass "
                f"{sec.get('pass')} | {_summary(name, sec)}",
                flush=True,
            )
    finally:
        torch.set_num_threads(threads_before)
    result["total_s"] = run.elapsed()
    result["kernels"] = kernels_state()
    write()
    print(f"\ntotal {result['total_s']:.1f} s; JSON in {out_path}")
    print("| section | pass | wall (s) | acceptance |")
    print("|---|---|---|---|")
    for name in SECTIONS:
        sec = result[name]
        wall = f"{sec['wall_s']:.1f}" if "wall_s" in sec else "-"
        verdict = f"skipped ({sec['skipped']})" if "skipped" in sec else sec.get("pass")
        print(f"| {name} | {verdict} | {wall} | {ACCEPTANCE[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
