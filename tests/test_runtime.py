"""gna_lens.runtime: precision chosen by measurement, threads from the cores idle now, the CPU named.

Every test here holds on any CPU: the branches that depend on bfloat16's speed are driven by
``override_speed_probe`` (both ways on every machine), and the real measurement is checked on work
whose speed under autocast the test itself decides.
"""

import subprocess
import sys
import time

import pytest
import torch

from gna_lens import runtime
from gna_lens.errors import ConfigError
from gna_lens.runtime import (
    choose_precision,
    choose_threads,
    free_cores,
    measure_speed,
    override_speed_probe,
)


def _matmul():
    x = torch.randn(16, 16)
    return lambda: x @ x


def test_auto_takes_float32_when_bfloat16_is_measured_slower_and_says_why():
    checks = []
    with override_speed_probe((0.010, 0.105)):  # the AVX2-only EPYC of issue 28: 10.5x slower
        choice = choose_precision(
            "auto", run=_matmul(), device="cpu", what="a forward",
            check=lambda: checks.append(1) or (True, "fine"),
        )  # fmt: skip
    assert choice.autocast is None and choice.label == "float32"
    assert choice.reason.startswith("auto: float32, because bfloat16 autocast 10.50x slower")
    assert "10.0 ms vs 105.0 ms" in choice.reason and "override" in choice.reason
    assert choice.probe is not None and choice.probe.speedup == pytest.approx(0.010 / 0.105)
    assert checks == []  # no accuracy check for a precision that is not taken


def test_auto_takes_bfloat16_when_measured_faster_and_the_check_passes():
    with override_speed_probe((0.020, 0.010)):
        choice = choose_precision(
            "auto", run=_matmul(), device="cpu", what="a forward",
            check=lambda: (True, "moved by 0.001"),
        )  # fmt: skip
    assert choice.autocast == "bfloat16" and choice.label == "bfloat16 (autocast)"
    assert choice.reason.startswith(
        "auto: bfloat16 autocast, because bfloat16 autocast 2.00x faster"
    )
    assert choice.reason.endswith("; checked: moved by 0.001")
    assert choice.check_ok is True and choice.to_dict()["probe"]["speedup"] == 2.0


def test_auto_refuses_bfloat16_that_fails_the_check_or_is_not_faster_enough():
    with override_speed_probe((0.020, 0.010)):
        choice = choose_precision(
            "auto", run=_matmul(), device="cpu", what="w", check=lambda: (False, "moved by 9")
        )
    assert choice.autocast is None and choice.check_ok is False
    assert choice.reason.startswith("auto: float32, because bfloat16 fails the check (moved by 9)")
    # Within the noise margin: the exact arithmetic stays.
    with override_speed_probe((0.0105, 0.0100)):
        choice = choose_precision("auto", run=_matmul(), device="cpu", what="w")
    assert choice.autocast is None and f">= {runtime.MIN_SPEEDUP:.2f}x" in choice.reason


def test_explicit_choices_small_models_and_other_dtypes_measure_nothing():
    def boom():
        raise AssertionError("nothing should run")

    assert choose_precision("bfloat16", run=boom, device="cpu", what="w").autocast == "bfloat16"
    for value in (None, "float32", torch.float32):
        assert choose_precision(value, run=boom, device="cpu", what="w").autocast is None
    small = choose_precision("auto", run=boom, device="cpu", what="w", worth_it=(False, "4 heads"))
    assert small.reason == "auto: float32 (4 heads)" and small.probe is None
    half = choose_precision("auto", run=boom, device="cpu", what="w", weights_dtype=torch.bfloat16)
    assert half.autocast is None and "weights torch.bfloat16" in half.reason
    with pytest.raises(ConfigError, match=r"sweep_dtype='auto' needs a probe to time \(run=None\)"):
        choose_precision("auto", run=None, device="cpu", what="w")
    with pytest.raises(ConfigError, match=r"sweep_dtype='fp8'; expected 'auto'"):
        choose_precision("fp8", run=boom, device="cpu", what="w")


def test_measure_speed_times_both_precisions_and_stops_early_when_one_pair_decides():
    calls = {"bf16": 0, "fp32": 0}

    def work(slower=30.0, base=0.001):  # slow only under bfloat16 autocast (an AVX2-only CPU)
        if torch.is_autocast_enabled("cpu"):
            calls["bf16"] += 1
            time.sleep(base * slower)
        else:
            calls["fp32"] += 1
            time.sleep(base)

    probe = measure_speed(work, device="cpu", what="sleep", repeats=3)
    assert probe.source == "measured" and probe.speedup < 0.2
    assert probe.repeats == 1 and calls == {"bf16": 2, "fp32": 2}  # warm-up + one, then gave up
    # 1.5x slower (AVX512-BF16 without AMX): it cannot be chosen either, so one timed run too
    probe = measure_speed(lambda: work(1.6, 0.02), device="cpu", what="sleep", repeats=3)
    assert probe.repeats == 1 and probe.speedup < 0.8

    # 4x faster (AMX): well past MIN_SPEEDUP after one timed run, so that decides it too (the
    # margin holds a busy machine's late wake-ups of 20 ms)
    probe = measure_speed(lambda: work(0.25, 0.08), device="cpu", what="sleep", repeats=3)
    assert probe.repeats == 1 and probe.speedup > 1.4

    def even():
        time.sleep(0.02)

    probe = measure_speed(even, device="cpu", what="sleep", repeats=3)
    assert probe.repeats == 3 and 0.3 < probe.speedup < 3
    assert "cores" in probe.hardware and probe.device == "cpu"


def test_override_is_scoped_and_still_runs_the_work_once_each_way():
    seen = []
    with override_speed_probe(lambda what, device: (1.0, 0.5)):
        probe = measure_speed(lambda: seen.append(torch.is_autocast_enabled("cpu")),
                              device="cpu", what="w")  # fmt: skip
    assert (probe.source, probe.speedup, seen) == ("override", 2.0, [False, True])
    assert runtime._OVERRIDE == []


def _fake_stat(monkeypatch, samples):
    it = iter(samples)
    monkeypatch.setattr(runtime, "_cpu_times", lambda path="/proc/stat": next(it))
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_free_cores_counts_what_is_idle_between_two_samples(monkeypatch):
    # cpu0 fully busy (a job still running), cpu1 idle: one core free, whatever the load average.
    _fake_stat(monkeypatch, [
        {"cpu0": (1000, 2000), "cpu1": (500, 2000), "cpu7": (0, 10)},
        {"cpu0": (1100, 2100), "cpu1": (500, 2100), "cpu7": (0, 20)},  # cpu7: not ours
    ])  # fmt: skip
    assert free_cores(0.0) == (1.0, 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (2.0, 2.0, 2.0), raising=False)
    _fake_stat(monkeypatch, [
        {"cpu0": (1000, 2000), "cpu1": (500, 2000)},
        {"cpu0": (1010, 2100), "cpu1": (505, 2100)},  # the job ended: both ~idle
    ])  # fmt: skip
    n, why = choose_threads(None, interval=0.0)
    assert n == 2 and "1.9 of 2 cores idle now" in why
    _fake_stat(monkeypatch, [
        {"cpu0": (1000, 2000), "cpu1": (500, 2000)},
        {"cpu0": (1100, 2100), "cpu1": (560, 2100)},  # one core busy, the other 60%
    ])  # fmt: skip
    assert choose_threads(None, interval=0.0)[0] == 1


def test_free_cores_sees_a_busy_process_on_this_machine():
    if free_cores(0.05) is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"]
    )
    try:
        time.sleep(0.3)
        busy = free_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None
    idle, cores = busy
    assert idle <= cores - 0.6, busy  # the spinning process holds about one core


def test_choose_threads_takes_a_request_or_omp_num_threads(monkeypatch):
    assert choose_threads(2)[0] == 2
    with pytest.raises(ConfigError, match=r"threads=0; expected a positive int"):
        choose_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads(None)[1].endswith("(OMP_NUM_THREADS)")


def test_cpu_description_names_the_cpu_its_bfloat16_and_torch_kernels():
    text = runtime.cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in text
    assert ("no native bfloat16" in text) != runtime.native_bfloat16("cpu")


def test_auto_probes_a_small_model_only_where_its_float32_sweep_is_long(monkeypatch):
    """At most EXACT_ALL_MAX heads: float32 without probing where bfloat16 is not native or the
    sweep is estimated under PROBE_WORTH_S; probed (and taken where faster and checked) where it
    is estimated longer."""
    from gna_lens import sweep_policy as sp
    from gna_lens.testing import toy_gna_model, toy_gna_task

    model = toy_gna_model()
    task = toy_gna_task(model, n_samples=8)
    probes: list[str] = []

    def timed(what, device):
        probes.append(what)
        return (0.02, 0.01)

    def estimate(est):
        monkeypatch.setattr(sp, "_sweep_seconds", lambda m, t, n, repeats=3: (est, f"{n} heads"))

    monkeypatch.setattr(sp, "native_bfloat16", lambda device: True)
    estimate(sp.PROBE_WORTH_S - 1)
    with override_speed_probe(timed):
        dtype, rec = sp.resolve_sweep_dtype(model, "auto", task, n_swept=3)
    assert dtype is None and probes == []
    assert rec["sweep_dtype_choice"] == (
        "auto: float32 (a short sweep: estimated 59.0 s in float32, under PROBE_WORTH_S=60 s "
        "(3 heads))"
    )
    estimate(sp.PROBE_WORTH_S)
    with override_speed_probe(timed):
        dtype, rec = sp.resolve_sweep_dtype(model, "auto", task)
    assert dtype == "bfloat16" and len(probes) == 1, rec
    choice = rec["sweep_dtype_choice"]
    assert choice.startswith("auto: bfloat16 autocast, because bfloat16 autocast 2.00x faster")
    assert "; the float32 sweep is long (estimated 60 s: 4 heads); held-out numbers are" in choice
    # Without native bfloat16 nothing is estimated or probed.
    monkeypatch.setattr(sp, "native_bfloat16", lambda device: False)
    estimate(float("nan"))
    with override_speed_probe(timed):
        dtype, rec = sp.resolve_sweep_dtype(model, "auto", task)
    assert dtype is None and len(probes) == 1
    assert rec["sweep_dtype_choice"] == "auto: float32 (4 heads: a small model)"
