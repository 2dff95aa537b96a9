"""benchmarks/bench_gpu.py end to end on tiny configs on the CPU: every section runs its GPU
code path and writes its numbers; nothing is judged (``pass`` is null with ``--tiny``)."""

import json
import math

import pytest
from bench_helpers import load_benchmark


def _bench():
    return load_benchmark("bench_gpu.py")


def _number(x):
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_tiny_run_on_the_cpu_writes_every_section_with_numbers(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(out), "--tmp", str(tmp_path)]) == 0
    data = json.loads(out.read_text())
    assert data["tiny"] is True and data["judged"] is False
    for key in ("machine", "kernels", "date", "command", "acceptance", "total_s"):
        assert key in data, key
    assert data["machine"]["torch"] and "mamba_ssm" in data["kernels"]
    assert "--tiny" in data["command"]
    assert data["sections_run"] == list(bench.SECTIONS)
    for name in bench.SECTIONS:
        sec = data[name]
        assert "error" not in sec, (name, sec.get("traceback"))
        assert sec["pass"] is None, name  # tiny configs are not judged
        assert sec["acceptance"] and _number(sec["wall_s"]) and "config" in sec, name

    for model in ("zoo-mamba2", "zoo-llama"):
        row = data["agreement"]["models"][model]
        assert len(row["top4_cpu"]) == 4 and row["same_top4"]
        assert _number(row["max_abs_diff"]) and row["max_abs_diff"] <= 1e-3
    for model in ("mamba2-130m", "mamba-130m"):
        row = data["forward"]["models"][model]
        assert _number(row["hf_seconds"])
        for path in row["paths"].values():
            assert _number(path["seconds"]) and _number(path["ratio_vs_hf"])
            assert path["max_abs_logit_diff"] <= 1e-3 and path["relative_logit_diff"] <= 1e-3
    mat = data["materialize"]
    assert _number(mat["ratio"]) and mat["max_abs_last_logit_diff"] <= 1e-3
    assert mat["peak_above_fast_gib"] is None  # CUDA memory only
    scans = data["exact_scans"]["models"]
    assert list(scans) == list(bench.SCAN_MODELS)
    for model, row in scans.items():
        assert _number(row["seconds"]) and row["heads"] == row["n_exact"] > 0, model
        assert row["strategy_choice"] and row["auto_choice"]["strategy"], model
    assert "boot_transformers" in scans["llama-3.1-8b"]["built"]
    assert "load_model" in scans["mamba2-1.3b"]["built"]
    rates = data["distill"]["tokens_per_s"]
    assert set(rates) == {"stage1", "stage2"} and all(_number(v) for v in rates.values())

    printed = capsys.readouterr().out
    assert "| section | pass |" in printed and "[distill]" in printed


def test_only_skip_and_deadline_are_recorded(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--only", "forward,materialize"]
    assert bench.main([*argv, "--skip", "materialize", "--deadline", "0"]) == 0
    data = json.loads(out.read_text())
    assert data["forward"] == {"skipped": "deadline", "pass": None}
    assert data["materialize"]["skipped"].startswith("not selected")
    assert data["sections_run"] == []
    with pytest.raises(SystemExit):
        bench.main([*argv, "--only", "nonsense"])


def test_a_section_that_raises_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    bench = _bench()

    def broken(run):
        raise RuntimeError("boom")

    monkeypatch.setitem(bench.SECTION_FNS, "forward", broken)
    monkeypatch.setitem(bench.SECTION_FNS, "materialize", lambda run: {"config": {}, "pass": None})
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--device", "cpu", "--out", str(out), "--only", "forward,materialize"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["forward"]["error"] == "RuntimeError: boom" and data["forward"]["pass"] is None
    assert "boom" in data["forward"]["traceback"][-1]
    assert data["sections_run"] == ["forward", "materialize"]
