"""Where and in what arithmetic gna_lens runs: the CPU it is on, the torch threads it takes now,
and the precision of its sweeps and of distillation, chosen by measurement.

This module sits below every other one (it imports nothing of gna_lens but its errors): the
sweeps, the scan, distillation and the CLI ask it, and nothing else guesses. :func:`free_cores`
samples the idle cores *now*, not a load average; :func:`choose_precision` takes bfloat16 autocast
only where it is measured faster (on a CPU without native bfloat16 a bfloat16 matmul is often
~10x slower than float32, so flags alone decide nothing) and passes the caller's accuracy check.
Tests replace the measurement with :func:`override_speed_probe`.
"""

import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gna_lens.errors import ConfigError

__all__ = [
    "MIN_SPEEDUP",
    "PrecisionChoice",
    "SpeedProbe",
    "autocast",
    "choose_precision",
    "choose_threads",
    "cpu_description",
    "free_cores",
    "measure_speed",
    "native_bfloat16",
    "override_speed_probe",
]

#: bfloat16 autocast must be measured at least this many times faster than float32 to be taken:
#: a margin over the probe's timing noise, so that a machine where both run at the same speed
#: keeps the exact arithmetic instead of flipping between runs.
MIN_SPEEDUP = 1.15

#: Extensions named by :func:`cpu_description`, strongest first (``/proc/cpuinfo`` flag, name).
_EXTENSIONS = (
    ("amx_bf16", "AMX-BF16"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_vnni", "AVX512-VNNI"),
    ("avx512f", "AVX512F"),
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("asimd", "NEON"),
    ("sve", "SVE"),
)


# ----------------------------------------------------------------------------- the CPU
def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags from ``/proc/cpuinfo`` (``("", set())`` where unreadable)."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name, flags


def cpu_description() -> str:
    """The CPU as every timing should name it: model, usable cores, the vector extensions that
    set its speed (native bfloat16 or not) and the kernels torch picked.

    Examples:
        >>> text = cpu_description()
        >>> "cores" in text and "torch kernels" in text
        True
    """
    name, flags = _cpuinfo()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    ext = [label for flag, label in _EXTENSIONS if flag in flags]
    bf16 = "native bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "no native bfloat16"
    kernels = torch.backends.cpu.get_cpu_capability()
    return (
        f"{name or 'unknown CPU'} ({cores} cores; {', '.join(ext) or 'no x86/ARM vector flags'}"
        f": {bf16}; torch kernels {kernels})"
    )


def native_bfloat16(device: Any) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX-BF16 (read from ``/proc/cpuinfo``; ``False`` where it cannot be read).

    Information only: :func:`choose_precision` decides by measuring, and records this next to
    what it measured.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    return bool({"avx512_bf16", "amx_bf16"} & _cpuinfo()[1])


# ----------------------------------------------------------------------------- threads
def _cpu_times(path: str = "/proc/stat") -> dict[str, tuple[int, int]]:
    """``{cpuN: (busy, total)}`` jiffies of each CPU line of ``/proc/stat``."""
    out: dict[str, tuple[int, int]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
                continue
            # user nice system idle iowait irq softirq steal (guest is already in user)
            values = [int(v) for v in parts[1:9]]
            values += [0] * (8 - len(values))
            idle = values[3] + values[4]
            total = sum(values)
            out[parts[0]] = (total - idle, total)
    return out


def free_cores(interval: float = 0.3, *, stat_path: str = "/proc/stat") -> tuple[float, int] | None:
    """Idle cores now: ``(idle cores, usable cores)`` over the next ``interval`` seconds.

    Two samples of ``/proc/stat`` ``interval`` apart, over the CPUs this process may run on;
    time a hypervisor stole counts as busy. ``None`` where ``/proc/stat`` cannot be read (not
    Linux).

    Examples:
        >>> idle, cores = free_cores(0.05)
        >>> 0.0 <= idle <= cores
        True
    """
    try:
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except AttributeError:
        allowed = None
    try:
        first = _cpu_times(stat_path)
        time.sleep(interval)
        second = _cpu_times(stat_path)
    except (OSError, ValueError):
        return None
    names = [n for n in second if n in first and (allowed is None or n in allowed)]
    if not names:
        return None
    idle = 0.0
    for n in names:
        busy = second[n][0] - first[n][0]
        total = second[n][1] - first[n][1]
        idle += 1.0 - busy / total if total > 0 else 1.0
    return min(max(idle, 0.0), float(len(names))), len(names)


def choose_threads(requested: int | None = None, *, interval: float = 0.3) -> tuple[int, str]:
    """Torch threads for a long job, and why: ``requested``, else ``OMP_NUM_THREADS``, else the
    cores idle right now (:func:`free_cores`, rounded, at least one).

    Torch's threads spin while they wait for each other: on a machine whose cores are busy with
    other jobs, more threads than idle cores make a scan several times slower (SmolLM2 on two
    cores shared with a training job: 6.8 min with two threads, under 2 min with one). A load
    average would still count a job that ended a minute ago, so the cores are sampled now.

    Raises:
        ConfigError: For a ``requested`` count below 1.

    Examples:
        >>> choose_threads(3)
        (3, '3 torch thread(s) (--threads)')
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"threads={requested!r}; expected a positive int (e.g. --threads 2).")
        return requested, f"{requested} torch thread(s) (--threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        return n, f"{n} torch thread(s) (OMP_NUM_THREADS)"
    sample = free_cores(interval)
    if sample is None:
        n = torch.get_num_threads()
        return n, f"{n} torch thread(s) (torch's default: idle cores unknown here)"
    idle, cores = sample
    n = max(1, min(cores, round(idle)))
    return n, (f"{n} torch thread(s): {idle:.1f} of {cores} cores idle now; --threads to change")


# ----------------------------------------------------------------------------- precision
@dataclass(frozen=True)
class SpeedProbe:
    """One side-by-side timing of the same work in float32 and under bfloat16 autocast.

    Attributes:
        what: The work timed (e.g. ``"forward of 8 x 64 tokens"``).
        device: Where it ran (``"cpu"``, ``"cuda:0"``).
        float32_seconds: Median seconds of one run in float32.
        bfloat16_seconds: Median seconds of one run under bfloat16 autocast.
        repeats: Timed runs of each (after one warm-up each), interleaved.
        source: ``"measured"``, or ``"override"`` when :func:`override_speed_probe` set it.
        hardware: The device in words (:func:`cpu_description` on a CPU, the GPU's name).
    """

    what: str
    device: str
    float32_seconds: float
    bfloat16_seconds: float
    repeats: int
    source: str = "measured"
    hardware: str = ""

    @property
    def speedup(self) -> float:
        """float32 time / bfloat16 time (above 1: bfloat16 is faster)."""
        return self.float32_seconds / self.bfloat16_seconds if self.bfloat16_seconds > 0 else 0.0

    def describe(self) -> str:
        """One line: which is faster, by how much, and the two times."""
        ratio = self.speedup
        if ratio >= 1:
            rel = f"bfloat16 autocast {ratio:.2f}x faster than float32"
        else:
            rel = (
                f"bfloat16 autocast {1 / ratio if ratio > 0 else math.inf:.2f}x slower than float32"
            )
        src = "" if self.source == "measured" else f", {self.source}"
        n = f"median of {self.repeats}" if self.repeats > 1 else "one timed run each"
        return (
            f"{rel} ({self.what} on {self.device}: {self.float32_seconds * 1e3:.1f} ms vs "
            f"{self.bfloat16_seconds * 1e3:.1f} ms, {n}{src})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields and the speed-up, JSON-ready."""
        return asdict(self) | {"speedup": self.speedup}


_OVERRIDE: list[Callable[[str, str], tuple[float, float]]] = []
_OVERRIDE_LOCK = threading.Lock()


@contextlib.contextmanager
def override_speed_probe(
    probe: Callable[[str, str], tuple[float, float]] | tuple[float, float],
) -> Iterator[None]:
    """Replace :func:`measure_speed`'s timings inside the ``with`` block.

    ``probe`` is ``(float32 seconds, bfloat16 seconds)``, or a function of ``(what, device)``
    returning them. The work is still run once in each precision (so errors surface as they
    would); only the clock is replaced, and the probe says ``source="override"``.

    Examples:
        >>> with override_speed_probe((1.0, 4.0)):   # bfloat16 "4x slower"
        ...     probe = measure_speed(lambda: None, device="cpu", what="nothing")
        >>> probe.speedup, probe.source
        (0.25, 'override')
    """
    fn = probe if callable(probe) else (lambda what, device, p=probe: p)
    with _OVERRIDE_LOCK:
        _OVERRIDE.append(fn)  # type: ignore[arg-type]
    try:
        yield
    finally:
        with _OVERRIDE_LOCK:
            _OVERRIDE.remove(fn)  # type: ignore[arg-type]


def autocast(device: Any, dtype: Any) -> contextlib.AbstractContextManager[Any]:
    """The one way gna_lens enters mixed precision: ``torch.autocast`` in ``dtype`` on
    ``device``'s type (a device, ``"cuda:1"``, ``"cpu"``), or nothing for ``None`` /
    ``"float32"``.

    Examples:
        >>> import torch
        >>> with autocast("cpu", "bfloat16"):
        ...     torch.is_autocast_enabled("cpu")
        True
        >>> with autocast("cpu", None):
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    if dtype in (None, "float32", "none", torch.float32):
        return contextlib.nullcontext()
    low = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.autocast(torch.device(device).type, dtype=low)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hardware(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_description() if device.type == "cpu" else device.type


def measure_speed(
    run: Callable[[], Any],
    *,
    device: Any,
    what: str,
    repeats: int = 3,
    give_up: float = 1.25,
    settled: float = 1.4,
) -> SpeedProbe:
    """Time ``run()`` in float32 and under bfloat16 autocast on ``device``, side by side.

    One warm-up of each, then ``repeats`` interleaved timed runs of each; medians. The first
    timed pair ends the probe where it already decides with a margin: bfloat16 ``give_up`` times
    slower (it must be :data:`MIN_SPEEDUP` times *faster* to be chosen; on a CPU without native
    bfloat16 each run can take 10x longer, with it but without AMX about 1.5x) or ``settled``
    times faster (well past that bar: more pairs would not change the choice).

    Args:
        run: The work, e.g. a forward pass of the model on a batch of the task's prompts.
        device: The device it runs on (its type selects the autocast).
        what: The work in words, for the record.
        repeats: Timed runs of each precision.
        give_up: See above.
        settled: See above.

    Returns:
        A :class:`SpeedProbe`.

    Examples:
        >>> import torch
        >>> x, w = torch.randn(64, 128), torch.randn(128, 128)
        >>> probe = measure_speed(lambda: x @ w, device="cpu", what="a 64 x 128 matmul")
        >>> probe.float32_seconds > 0 and probe.bfloat16_seconds > 0
        True
    """
    device = torch.device(device)
    with _OVERRIDE_LOCK:
        override = _OVERRIDE[-1] if _OVERRIDE else None

    def timed(bf16: bool) -> float:
        _sync(device)
        start = time.perf_counter()
        with autocast(device, "bfloat16" if bf16 else None):
            run()
        _sync(device)
        return time.perf_counter() - start

    if override is not None:
        timed(False), timed(True)
        f32, b16 = override(what, str(device))
        return SpeedProbe(what, str(device), float(f32), float(b16), 1, "override",
                          _hardware(device))  # fmt: skip
    timed(False), timed(True)  # warm-up: first-call allocations and kernel choices
    f32s: list[float] = []
    b16s: list[float] = []
    for i in range(max(1, repeats)):
        f32s.append(timed(False))
        b16s.append(timed(True))
        if i == 0 and not 1 / give_up <= f32s[0] / b16s[0] < settled:
            break
    return SpeedProbe(
        what, str(device), statistics.median(f32s), statistics.median(b16s), len(f32s),
        "measured", _hardware(device),
    )  # fmt: skip


@dataclass(frozen=True)
class PrecisionChoice:
    """The arithmetic a sweep or a distillation runs in, and why.

    Attributes:
        requested: What was asked for (``"auto"``, ``"float32"``, ``"bfloat16"``).
        autocast: ``None`` (the model's own dtype) or ``"bfloat16"`` (autocast).
        reason: Why, in words (starts with ``"auto: "`` when chosen automatically).
        probe: The timing it rests on (``None`` where nothing was timed).
        check: The accuracy check's words (``None`` where none ran).
        check_ok: Whether that check passed (``None`` where none ran).
    """

    requested: str
    autocast: str | None
    reason: str
    probe: SpeedProbe | None = None
    check: str | None = None
    check_ok: bool | None = None

    @property
    def label(self) -> str:
        """``"float32"`` or ``"bfloat16 (autocast)"``, as recorded in result methods."""
        return "float32" if self.autocast is None else f"{self.autocast} (autocast)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the probe as a dict)."""
        out = asdict(self)
        out["probe"] = None if self.probe is None else self.probe.to_dict()
        return out


def _requested(value: Any, where: str) -> str:
    if value in (None, "float32", "none", torch.float32):
        return "float32"
    if value in ("bfloat16", torch.bfloat16):
        return "bfloat16"
    if value == "auto":
        return "auto"
    raise ConfigError(
        f"{where}={value!r}; expected 'auto' (bfloat16 autocast only where measured faster and "
        "accurate enough), None / 'float32' (the model's own arithmetic) or 'bfloat16'."
    )


def choose_precision(
    requested: Any,
    *,
    run: Callable[[], Any] | None,
    device: Any,
    what: str,
    weights_dtype: torch.dtype = torch.float32,
    worth_it: tuple[bool, str] = (True, ""),
    check: Callable[[], tuple[bool, str]] | None = None,
    where: str = "sweep_dtype",
    min_speedup: float = MIN_SPEEDUP,
) -> PrecisionChoice:
    """Resolve ``requested`` (``"auto"``, ``None`` / ``"float32"``, ``"bfloat16"``).

    ``"auto"`` keeps the model's own arithmetic where its weights are not float32 or where
    ``worth_it`` says there is nothing to gain (e.g. a small model), else times ``run`` in both
    precisions (:func:`measure_speed`) and takes bfloat16 autocast only where it is at least
    ``min_speedup`` times faster *and* ``check()`` (an accuracy check on the same model) passes.
    Other values are returned as given, with nothing measured.

    Args:
        requested: See above.
        run: The probe's work (a forward pass on the shape that will run); needed only when
            ``"auto"`` gets as far as timing.
        device: The device ``run`` uses.
        what: ``run`` in words.
        weights_dtype: The model's weights dtype.
        worth_it: ``(whether precision is worth trading, why not in words)``.
        check: ``() -> (ok, words)``; ``None``: no accuracy check.
        where: The argument's name, for errors.
        min_speedup: See :data:`MIN_SPEEDUP`.

    Returns:
        A :class:`PrecisionChoice`.

    Raises:
        ConfigError: For an unknown ``requested``.

    Examples:
        >>> import torch
        >>> x = torch.randn(8, 8)
        >>> with override_speed_probe((1.0, 3.0)):
        ...     choice = choose_precision("auto", run=lambda: x @ x, device="cpu", what="a matmul")
        >>> choice.autocast, choice.reason.split(" (")[0]
        (None, 'auto: float32, because bfloat16 autocast 3.00x slower than float32')
    """
    asked = _requested(requested, where)
    if asked != "auto":
        return PrecisionChoice(asked, None if asked == "float32" else "bfloat16", "requested")
    if weights_dtype != torch.float32:
        return PrecisionChoice(
            "auto", None, f"auto: the model's own dtype (weights {weights_dtype})"
        )
    ok, why = worth_it
    if not ok:
        return PrecisionChoice("auto", None, f"auto: float32 ({why})")
    if run is None:
        raise ConfigError(
            f"{where}='auto' needs a probe to time (run=None) for a model worth probing. Fix: "
            "pass run=, e.g. a forward pass on the prompts the sweep will use."
        )
    probe = measure_speed(run, device=device, what=what)
    native = native_bfloat16(device)
    hw = f"; {'native' if native else 'no native'} bfloat16 on {probe.hardware or probe.device}"
    if probe.speedup < min_speedup:
        return PrecisionChoice(
            "auto", None,
            f"auto: float32, because {probe.describe()}; bfloat16 needs >= {min_speedup:.2f}x"
            f"{hw}",
            probe,
        )  # fmt: skip
    if check is None:
        return PrecisionChoice(
            "auto", "bfloat16", f"auto: bfloat16 autocast, because {probe.describe()}{hw}", probe
        )
    passed, words = check()
    if not passed:
        return PrecisionChoice(
            "auto", None,
            f"auto: float32, because bfloat16 fails the check ({words}), although "
            f"{probe.describe()}",
            probe, words, False,
        )  # fmt: skip
    return PrecisionChoice(
        "auto", "bfloat16",
        f"auto: bfloat16 autocast, because {probe.describe()}{hw}; checked: {words}",
        probe, words, True,
    )  # fmt: skip


def output_folder(out: Any, where: str) -> Path | None:
    """Check, before any work, that a run can write its output folder, so that a run is never
    lost at its end (``None``: the run writes nothing). Nothing is made here: the folder is made
    when the run writes, so a run refused later leaves nothing behind.

    Args:
        out: The folder (new or existing), or ``None``.
        where: The caller, for the message (``"scan(out=...)"``, ``"--out"``).

    Returns:
        The folder as a :class:`~pathlib.Path`, or ``None``.

    Raises:
        ConfigError: If ``out`` or a folder above it is a file, or the nearest existing folder
            is not writable.

    Examples:
        >>> import tempfile
        >>> output_folder(Path(tempfile.mkdtemp()) / "run" / "a", "scan(out=...)").name
        'a'
    """
    if out is None:
        return None
    folder = Path(out)
    there = folder
    while not there.exists() and there.parent != there:
        there = there.parent
    if not there.is_dir():
        which = "is a file" if there == folder else f"is under {str(there)!r}, a file"
        raise ConfigError(
            f"{where} {str(out)!r} {which}; expected a folder to write into (new or existing). "
            "Fix: another folder, or move the file."
        )
    if not os.access(there, os.W_OK):
        raise ConfigError(
            f"{where} {str(out)!r}: {str(there)!r} is not writable; pass a folder you can write to."
        )
    return folder
