"""Sweeps sharded over Ray workers (gna_lens.distributed.RayExecutor).

One local Ray instance per session (2 CPUs); the workers load a tiny checkpoint folder through
load_model, as they load a user's model by name or folder.
"""

import functools
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from interventions_helpers import KEYS, tok

from gna_lens import ablation_sweep, load_model, score_heads
from gna_lens.distributed import RayExecutor, ray_init_kwargs
from gna_lens.errors import ConfigError, GnaLensError, WorkerError
from gna_lens.interventions import control_sweep, layer_sweep, prune_from_end
from gna_lens.interventions.engine import PLANNERS, SweepJob, run_sweeps
from gna_lens.tasks import kv_retrieval, text_control
from gna_lens.testing import tiny_checkpoint, tiny_hooked_ssm

try:
    import ray
except ImportError:  # the extra gna-lens[ray] is not installed
    ray = None


def test_import_gna_lens_never_imports_ray():
    code = (
        "import sys, gna_lens, gna_lens.distributed\n"
        "from gna_lens import RayExecutor\n"
        "RayExecutor(workers=2)\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_model_built_in_memory_is_refused_before_ray_starts():
    model = tiny_hooked_ssm("mamba2", vocab_size=len(tok()))
    task = kv_retrieval(tok(), n_pairs=3, n_samples=2, words=KEYS, seed=0)
    with pytest.raises(ConfigError, match="model_source=<that folder>"):
        ablation_sweep(model, task, "logit_diff", progress=False, executor=RayExecutor(workers=2))


def test_the_weights_fingerprint_is_recomputed_only_after_an_edit(monkeypatch):
    """Summing every parameter is serial time of each sweep: it is skipped when no parameter was
    replaced or edited in place since the last sweep, and recomputed after either."""
    from gna_lens import distributed

    model = tiny_hooked_ssm("mamba2", vocab_size=len(tok()))
    calls = []
    real = distributed._fingerprint
    monkeypatch.setattr(distributed, "_fingerprint", lambda m: calls.append(1) or real(m))
    ex = RayExecutor(workers=2)
    first = ex._fingerprint_of(model)
    assert ex._fingerprint_of(model) == first and len(calls) == 1
    p = next(model.parameters())
    with torch.no_grad():
        p.add_(1.0)  # in place: the version counter moves
    edited = ex._fingerprint_of(model)
    assert len(calls) == 2 and edited != first
    p.data = p.data.clone()  # replaced storage, same values
    assert ex._fingerprint_of(model) == edited and len(calls) == 3
    assert ex._fingerprint_of(tiny_hooked_ssm("mamba2", vocab_size=len(tok()))) and len(calls) == 4


# ----------------------------------------------------------------------------- on a Ray instance
@pytest.fixture(scope="module")
def ray_instance():
    if ray is None:
        pytest.skip("needs the extra gna-lens[ray]")
    started = not ray.is_initialized()
    if started:
        t0 = time.perf_counter()
        ray.init(**ray_init_kwargs(None, {"num_cpus": 2, "log_to_driver": False}))
        print(f"ray.init: {time.perf_counter() - t0:.1f} s")
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """The folder of a tiny Llama (4 layers x 4 heads), with its tokenizer."""
    path = tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("llama"), vocab_size=len(tok()), num_hidden_layers=4
    )
    tok().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(llama_path):
    """The tiny Llama loaded from its folder, and a KV task."""
    model = load_model(llama_path)
    task = kv_retrieval(tok(), n_pairs=4, n_samples=12, words=KEYS, seed=0)
    return model, task


class _Faulty(RayExecutor):
    """When armed, acts once right after worker 0's first finished unit (its next unit is then
    in flight): ``"kill"`` kills it with ray.kill, ``"interrupt"`` raises KeyboardInterrupt (as
    Ctrl-C in the sweep's loop)."""

    armed = False
    action = "kill"

    def _unit_done(self, slot, unit):
        if self.armed and slot.index == 0:
            self.armed = False
            self.hit = slot.actor
            if self.action == "interrupt":
                raise KeyboardInterrupt
            ray.kill(slot.actor, no_restart=True)


@pytest.fixture(scope="module")
def pool(ray_instance, llama):
    """Two workers with one CPU thread each (the instance's 2 CPUs), each with the model loaded.
    Every test shares them: a second executor would wait for CPUs these hold.

    Tests replace these workers often (a killed worker, another model); on a loaded machine a
    new worker process may take minutes to start (Ray counts that as placement), so the pool
    waits up to 10 minutes for one instead of the default minute: a test is about its sweep,
    not about how busy the machine is (the placement timeout has a test of its own)."""
    ex = _Faulty(workers=2, place_timeout=600).start(llama[0])
    yield ex
    ex.close()


def test_workers_run_at_the_callers_niceness_not_rays_15(ray_instance):
    """Beside other busy processes, Ray's niceness-15 workers got about 4% of a core each and the
    sweeps stalled: the local instance runs them at the caller's niceness."""
    nice = ray.remote(num_cpus=1)(lambda: os.nice(0))
    assert ray.get(nice.remote(), timeout=120) == os.nice(0)
    assert ray_init_kwargs("auto", {})["address"] == "auto"  # joining a cluster: its config


@pytest.mark.parametrize("pack", [None, 3])
@pytest.mark.parametrize("positions", [None, "last"])
def test_sharded_sweep_equals_one_process_bit_for_bit(llama, pool, positions, pack):
    """Bit for bit with a pinned pack (guaranteed: each worker packs its cells as one process
    does); with automatic packing to float rounding (as the recipe says: here the shared
    prefix's pass, one row per packed cell, has another height in a one-cell unit)."""
    model, task = llama
    pool.start(model)  # both workers ready (an earlier test may have stopped them): both take part
    kw = dict(positions=positions, pack=pack, progress=False)
    local = ablation_sweep(model, task, "logit_diff", **kw)
    sharded = ablation_sweep(model, task, "logit_diff", executor=pool, **kw)
    assert sharded.cells == local.cells
    if pack is None:
        assert (sharded.values - local.values).abs().max() <= 1e-5
    else:
        assert torch.equal(sharded.values, local.values)
    assert torch.equal(sharded.baseline, local.baseline)
    assert sharded.method == local.method
    ex = sharded.info["executor"]
    assert ex["workers"] == 2 and ex["threads_per_worker"] == 1 and ex["restarts"] == 0
    assert all(n > 0 for n in ex["units_by_worker"]), ex  # both workers took part
    assert sum(ex["units_by_worker"]) == ex["units"] > 2
    # each worker's time inside its units, and its CPU time there (how well the sharding ran)
    assert len(ex["busy_seconds"]) == len(ex["cpu_seconds"]) == 2
    assert all(0 < b <= ex["wall_seconds"] + 0.05 for b in ex["busy_seconds"]), ex


def test_units_on_other_prompts_finishing_in_any_order_land_on_their_prompts(
    llama, pool, monkeypatch
):
    """Prompts split over several blocks (a small memory budget), units handed out shuffled,
    several per worker: every value must land on its own cell and prompt. (With one block of
    prompts 0..11 in order, writing a unit's values to the wrong prompts went unnoticed.)"""
    import random

    from gna_lens import distributed

    model, task = llama
    pool.start(model)  # both workers ready: each takes units
    kw = dict(memory_budget="16KiB", progress=False)
    local = ablation_sweep(model, task, "logit_diff", **kw)
    # the values differ from prompt to prompt, so a value on another prompt shows
    assert not torch.equal(local.values, local.values[:, torch.arange(12).roll(1)])
    real, seen = distributed.plan_units, {}

    def shuffled(*args, **kwargs):
        units = real(*args, **kwargs)
        random.Random(0).shuffle(units)
        seen["units"] = units
        return units

    monkeypatch.setattr(distributed, "plan_units", shuffled)
    sharded = ablation_sweep(model, task, "logit_diff", executor=pool, **kw)
    blocks = {u.parts for u in seen["units"]}
    assert len(blocks) >= 3, blocks  # units hold different prompts
    assert [u.id for u in seen["units"]] != sorted(u.id for u in seen["units"])
    assert all(n >= 2 for n in sharded.info["executor"]["units_by_worker"])
    assert torch.equal(sharded.values, local.values)
    assert torch.equal(sharded.baseline, local.baseline)


def test_score_heads_shards_task_and_control_with_the_same_numbers(llama, pool):
    model, task = llama
    control = text_control(model.tokenizer, n_sequences=3, seq_len=12, max_unknown=1.0)
    # bfloat16 autocast: the workers must run under the caller's autocast too
    kw = dict(control=control, n_examples=0, progress=False, sweep_dtype="bfloat16")
    local = score_heads(model, task, **kw)
    sharded = score_heads(model, task, executor=pool, **kw)
    for col in ("ablation_effect", "control_effect", "specificity"):  # NaN: neither effect
        torch.testing.assert_close(
            sharded.scores[col], local.scores[col], rtol=0, atol=0, equal_nan=True
        )
    assert "Ray, 2 workers" in sharded.method["executor"]
    assert "control sweep 0 restart(s)" in sharded.method["executor"]
    ctrl = control_sweep(model, control, progress=False, executor=pool)
    assert torch.equal(ctrl.values, control_sweep(model, control, progress=False).values)


def _arm(ex, model, action="kill"):
    """Start the workers if a test stopped them (and wait for a replaced one), then arm."""
    ex.start(model)
    ex.armed, ex.action = True, action


def test_a_worker_killed_mid_sweep_is_replaced_and_every_cell_runs_once(llama, pool):
    model, task = llama
    local = ablation_sweep(model, task, "logit_diff", progress=False)
    _arm(pool, model)
    res = ablation_sweep(model, task, "logit_diff", progress=False, executor=pool)
    assert not pool.armed  # the kill happened
    info = res.info["executor"]
    assert info["restarts"] == 1 and info["reruns"] >= 1
    assert info["failures"][0].startswith("worker 0: ActorDiedError")
    assert sum(info["units_by_worker"]) == info["units"]  # no unit lost or counted twice
    assert torch.equal(res.values, local.values) and torch.equal(res.baseline, local.baseline)


def test_ctrl_c_stops_every_worker(llama, pool):
    model, task = llama
    _arm(pool, model, action="interrupt")
    actors = [s.actor for s in pool._slots]
    with pytest.raises(KeyboardInterrupt):
        ablation_sweep(model, task, "logit_diff", progress=False, executor=pool)
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.placed.remote(), timeout=60)


def test_a_worker_with_other_weights_refuses_to_run(pool, tmp_path):
    path = tiny_checkpoint("mamba2", tmp_path / "m", vocab_size=len(tok()))
    model = load_model(path)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # edited after loading: the folder no longer has it
    task = kv_retrieval(tok(), n_pairs=3, n_samples=2, words=KEYS, seed=0)
    with pytest.raises(WorkerError, match="other weights than the caller's"):
        ablation_sweep(model, task, "logit_diff", progress=False, executor=pool)


def test_scan_cli_workers_and_address_reach_the_executor(monkeypatch, tmp_path):
    from gna_lens import cli, scan

    seen = {}

    def fake_scan(model, task, **kw):
        seen["executor"] = kw["executor"]
        raise ConfigError("stop here")

    from gna_lens import zoo

    # the CLI builds a zoo model's tasks from its tokenizer before the scan starts
    monkeypatch.setattr(scan, "load_scan_model", lambda name, **kw: zoo.load(name))
    monkeypatch.setattr(scan, "scan", fake_scan)
    monkeypatch.setattr(RayExecutor, "close", lambda self: seen.setdefault("closed", True))
    argv = ["scan", "zoo-llama", "--workers", "3", "--ray-address", "auto", "--threads", "2"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    ex = seen["executor"]
    assert isinstance(ex, RayExecutor) and seen["closed"]
    assert (ex.workers, ex.address, ex.threads_per_worker) == (3, "auto", 2)


def test_mamba1_channel_groups_are_refused_before_ray_starts():
    """A worker's fresh copy would not have the caller's groups: its cells would be channels."""
    model = tiny_hooked_ssm("mamba1", vocab_size=len(tok()))
    task = kv_retrieval(tok(), n_pairs=3, n_samples=2, words=KEYS, seed=0)
    with model.head_groups(16), pytest.raises(GnaLensError, match="channel groups"):
        ablation_sweep(model, task, "logit_diff", progress=False, executor=RayExecutor(workers=2))


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_layer_sweep_shards_task_and_control_with_the_same_numbers(llama, pool, mode):
    """Layer cells run on the same engine as head cells, so they shard the same way: the
    task's and the control's values are those of one process, bit for bit."""
    model, task = llama
    control = text_control(model.tokenizer, n_sequences=3, seq_len=12, max_unknown=1.0)
    kw = dict(control=control, mode=mode, removed=[3], max_rows=4, progress=False)
    if mode == "mean":
        kw["reference"] = task
    local = layer_sweep(model, task, "logit_diff", **kw)
    sharded = layer_sweep(model, task, "logit_diff", executor=pool, **kw)
    assert sharded.cells == local.cells == ((0,), (1,), (2,))
    for a, b in (
        (sharded.values, local.values),
        (sharded.baseline, local.baseline),
        (sharded.control_values, local.control_values),
        (sharded.control_baseline, local.control_baseline),
    ):
        assert torch.equal(a, b)
    assert not torch.equal(local.values, local.values[:, torch.arange(12).roll(1)])
    ex = sharded.method["executor"]
    assert ex["workers"] == 2 and sum(ex["units_by_worker"]) == ex["units"] >= 2
    assert "control_executor" in sharded.method
    for key in ("mean_over", "control_mean_over") if mode == "mean" else ():
        assert sharded.method[key] == local.method[key]


def test_the_cells_left_are_named_for_every_kind_of_cell():
    """The message a failed sharded sweep ends with names the cells it did not finish, whatever
    they are: head sets, layer cells, hook cells and residual patches (a layer cell made it
    raise a TypeError instead). Checked on the scheduler's own bookkeeping, without Ray."""
    from types import SimpleNamespace

    from gna_lens.distributed import _Run, _Unit
    from gna_lens.interventions.engine import HookCell

    cells = [
        ((0, 1), (1, 2)),  # a head set
        HookCell(start=2, hooks=(("blocks.2.hook_resid_post", print),), label="layer 2 block"),
        HookCell(start=1, resid=lambda group, resid: resid, label="L1 pos 5"),  # a patch
        HookCell(start=3),  # no label
    ]
    run = object.__new__(_Run)
    run.sweep = SimpleNamespace(cells=cells)
    run.units = [_Unit(i, i, i + 1, (0,)) for i in range(len(cells))]
    run.done = {0}
    left = run.cells_left()
    assert left.startswith("3 of 4 cells in 3 units: ")
    for name in ("layer 2 block", "L1 pos 5", "cell at layer 3"):
        assert name in left, left
    run.done = set()
    assert run.label(0, 1) == "L0H1+L1H2"
    assert run.label(0, 4) == "L0H1+L1H2 .. cell at layer 3 (4 cells)"


# ----------------------------------------------------------------------------- planted faults
#: Each kind of cell a sharded sweep runs, by the labels of its cells on the tiny Llama (4 layers
#: x 4 heads): head sets (ablation_sweep), layer cells (layer_sweep), hook cells of several
#: layers (prune_from_end) and residual patches (the patching planner of ``_planted``).
LABELS = {
    "head": [f"L{layer}H{head}" for layer in range(4) for head in range(4)],
    "layer": ["L0", "L1", "L2", "L3"],
    "hook": ["L3", "L2+L3", "L1-L3"],
    "patch": ["L0 last", "L1 last", "L2 last", "L3 last"],
}


@functools.cache  # one source per fault: the pool keeps workers started with it
def _planted(path, fault=None):
    """A model source for the workers that plants ``fault`` there, and a patching planner.

    Patching has no ``executor=`` of its own, so its cells reach the executor as the planner
    ``"test patch"`` (registered here with ``monkeypatch`` and, by the source, in each worker;
    ``run_sweeps`` hands its plan to the executor as every sweep does). Both functions are
    nested so that Ray pickles them by value (a worker cannot import this test module).

    Args:
        path: The model's folder (the source loads it: the caller's weights).
        fault: ``None`` (load the model), ``"load"`` (loading raises), ``"stall"`` (loading
            never ends) or ``"raise"`` (every unit raises a RuntimeError, not a GnaLensError).

    Returns:
        ``(source, planner)``.
    """

    def plan_patches(model, on, layers, check_edits=True):
        """Per layer, the residual entering it at the last position patched from the
        previous prompt of the batch (``HookCell(resid=...)``, as ``patch_residual``'s)."""
        from gna_lens.heads import Subject
        from gna_lens.interventions.batching import length_groups
        from gna_lens.interventions.engine import CellSweep, HookCell, SweepPlan
        from gna_lens.interventions.metrics import Metric
        from gna_lens.interventions.runner import Runner

        def resid(group, r):
            r = r.clone()
            r[:, -1] = r[:, -1].roll(1, 0)
            return r

        subject = Subject.of(model)
        cells = [HookCell(start=layer, resid=resid, label=f"L{layer} last") for layer in layers]
        groups = length_groups(on, 64, subject.device)
        return CellSweep(
            Runner(subject), cells, groups, None, Metric("logit_diff", on), None,
            SweepPlan(0, 64, None), "batched", len(on),
        )  # fmt: skip

    def source():
        from gna_lens import load_model
        from gna_lens.interventions import engine

        engine.PLANNERS["test patch"] = plan_patches
        if fault == "load":
            raise RuntimeError("planted: the model cannot load")
        if fault == "stall":
            time.sleep(3600)  # the executor kills the worker long before
        if fault == "raise":

            def run_cells(*args, **kwargs):
                raise RuntimeError("planted: a unit raised")

            engine.run_cells = run_cells  # in this worker only
        return load_model(path)

    return source, plan_patches


def _sweep(kind, model, task, executor):
    """A sweep of ``kind`` cells (:data:`LABELS`) on ``executor``."""
    kw = dict(progress=False, executor=executor)
    if kind == "head":
        ablation_sweep(model, task, "logit_diff", **kw)
    elif kind == "layer":
        layer_sweep(model, task, "logit_diff", control=None, **kw)
    elif kind == "hook":
        prune_from_end(model, task, "logit_diff", control=None, **kw)
    else:
        job = SweepJob("test patch", {"on": task, "layers": [0, 1, 2, 3]})
        run_sweeps(model, [job], "patching", executor, progress=False)


def _names(text, kind):
    """The cell names in ``text`` (``"L0H0 .. L0H3 (4 cells), L1H0"``), each checked to be a
    cell of ``kind``."""
    names = []
    for unit in text.split(", "):
        names += re.sub(r" \(\d+ cells\)$", "", unit).split(" .. ")
    assert names and all(n in LABELS[kind] for n in names), (names, LABELS[kind])
    return names


def _check_cells_left(msg, kind, all_left=True):
    """``msg`` names the cells of ``kind`` left: all of them, or (``all_left=False``) some."""
    labels = LABELS[kind]
    # the names run to the next full stop (not to the dots of "L0H0 .. L0H3")
    m = re.search(
        rf"cells not done: (\d+) of {len(labels)} cells in (\d+) units: (.+?)(?<!\.)\.(?!\.)",
        msg,
        re.I,
    )
    assert m, msg
    left, units, shown = int(m[1]), int(m[2]), m[3]
    more = re.search(r", and (\d+) more units$", shown)
    if more:
        shown = shown[: more.start()]
        assert units > 8 and int(more[1]) == units - 8, msg
    names = _names(shown, kind)
    if all_left:
        assert left == len(labels) and names[0] == labels[0], msg
        assert more or names[-1] == labels[-1], msg  # every unit is named
    else:
        assert 0 < left < len(labels), msg
    assert "TypeError" not in msg


@pytest.fixture
def planted(llama_path, pool, monkeypatch):
    """``planted(fault, **settings)``: the pool's workers replaced by ones with ``fault``
    (:func:`_planted`) and the executor's ``settings``; all restored after the test."""

    def plant(fault=None, **settings):
        source, planner = _planted(llama_path, fault)
        monkeypatch.setitem(PLANNERS, "test patch", planner)
        for name, value in ({"model_source": source} | settings).items():
            monkeypatch.setattr(pool, name, value)
        return pool

    return plant


KINDS = list(LABELS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_ray_cannot_place_stops_the_sweep_naming_the_cells_left(
    llama, llama_path, pool, monkeypatch, kind
):
    """The pool holds the instance's 2 CPUs: another executor's worker is never placed."""
    model, task = llama
    monkeypatch.setitem(PLANNERS, "test patch", _planted(llama_path)[1])  # here only: no worker
    pool.start(model)  # its workers as they are (started again if a test stopped them)
    with (
        RayExecutor(workers=1, threads_per_worker=1, place_timeout=0) as other,
        pytest.raises(WorkerError) as err,
    ):
        _sweep(kind, model, task, other)
    msg = str(err.value)
    assert "Ray could not place worker 0 within 0 s: it needs 1 CPU(s); free now: 0 CPUs" in msg
    _check_cells_left(msg, kind)
    assert other._slots == [] and len(pool._slots) == 2  # only its own worker was stopped


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["load", "stall", "raise"])
def test_a_fault_in_a_worker_stops_the_sweep_naming_the_cells_left(
    llama, pool, planted, kind, fault
):
    """A worker that cannot load the model, does not load it within start_timeout, or raises
    an error that is not one of the sweep's inputs (it would recur): the sweep stops at once."""
    model, task = llama
    # start_timeout: a short one only where the load stalls (a real load takes seconds)
    planted(fault, workers=1, **({"start_timeout": 1.0} if fault == "stall" else {}))
    with pytest.raises(WorkerError) as err:
        _sweep(kind, model, task, pool)
    msg = str(err.value)
    expected = {
        "load": r"worker 0 could not set up the model \(factory .*source\(\)\): RuntimeError: "
        r"planted: the model cannot load; cells not done: ",
        "stall": r"worker 0 did not load the model from factory .*source\(\) within 1 s "
        r"\(start_timeout\); cells not done: ",
        "raise": r"worker 0 raised RuntimeError on cells (.+?): planted: a unit raised\. The "
        r"sweep stopped; cells not done: ",
    }[fault]
    m = re.search(expected, msg)
    assert m, msg
    if fault == "raise":
        _names(m[1], kind)  # the unit that raised, by its cells
    _check_cells_left(msg, kind)
    assert pool._slots == []


@pytest.mark.parametrize("kind", KINDS)
def test_too_many_failures_stop_the_sweep_naming_the_cells_left(llama, pool, planted, kind):
    """Worker 0 is killed after its first unit: with max_restarts=0 the sweep stops, naming
    the cells not done (some are), and stops every worker. One worker is enough for the
    message; two for head cells (each new worker process is most of what these tests cost)."""
    model, task = llama
    planted(max_restarts=0, workers=2 if kind == "head" else 1)
    _arm(pool, model)
    with pytest.raises(WorkerError) as err:
        _sweep(kind, model, task, pool)
    assert not pool.armed  # the kill happened
    msg = str(err.value)
    assert "max_restarts=0" in msg and "ActorDiedError" in msg, msg
    _check_cells_left(msg, kind, all_left=False)
    assert pool._slots == []  # every worker was stopped
