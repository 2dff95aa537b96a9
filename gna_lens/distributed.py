"""Sweeps sharded over Ray workers: :class:`RayExecutor`.

Exact single-head ablation costs one ablated evaluation of the prompt set per head; on a model
with a thousand heads that fills a GPU, it is the step worth spreading over several GPUs or
machines. ``ablation_sweep(..., executor=RayExecutor(...))``, ``control_sweep``, ``score_heads``,
``scan`` and ``gna-lens scan --workers N`` hand the cells of a sweep to Ray actors, each holding
its own copy of the model, loaded once by name or folder.

How a sweep is sharded, and why the numbers are those of one process:

- The caller plans the sweep as it would run it alone (prompt batches, rows per forward pass: a
  function of the model's config and the whole cell list, never of timing). Each worker plans it
  again from the same arguments on its copy, and runs *units*: a contiguous range of cells (cut
  where the first ablated layer changes, so one layer's heads share their runs) on a block of
  prompt batches (one block unless the clean runs of every prompt would not fit the sweep's
  ``memory_budget``). A worker runs the clean forward of a prompt batch once and reuses it for
  every unit it is given.
- Each cell is computed by the same code on the same inputs as in one process. On CPUs the values
  are bit for bit those of one process (tested; the packing of cells into a batch does not change
  a row's result there). On GPUs, kernels may round a row differently by batch shape, so a cell
  packed with other cells than in one process may differ by float rounding (~1e-6 relative in
  float32), as between two single-process runs with different ``pack``. Where the engine expands
  cells at the layer's output instead of packing them (chosen per process by timing, checked to
  reproduce the packed run to 2e-6), the same bound applies.
- Units are handed out as workers finish (two in flight per worker); the progress bar counts
  every worker's finished units.

Faults: a worker that dies (killed, out of memory, its node lost) is replaced by a new actor that
loads the model again; its unfinished units run again; values are written once per cell and
checked to be. After ``max_restarts`` replacements in one sweep, the sweep stops with a
:class:`~gna_lens.errors.WorkerError` that names the cells left and the worker's error. Errors of
the sweep's own inputs (a :class:`~gna_lens.errors.GnaLensError` raised in a worker) are raised
as they are; any other exception raised in a worker stops the sweep at once (it would recur).
On Ctrl-C or any error the workers are killed.

Importing this module (and ``import gna_lens``) does not import Ray; it is imported when a sweep
first runs on a :class:`RayExecutor`. Install it with ``pip install 'gna-lens[ray]'``.
"""

import contextlib
import itertools
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from gna_lens.device import HOST, host_full
from gna_lens.errors import ConfigError, GnaLensError, WorkerError
from gna_lens.heads import HookedModel
from gna_lens.render.markdown import heads_label
from gna_lens.runtime import autocast

__all__ = ["RayExecutor"]

#: Units in flight per worker: one running, one queued behind it (hides the round trip).
IN_FLIGHT = 2
#: Relative tolerance of the weights fingerprint check (sums of every parameter in float64).
FINGERPRINT_RTOL = 1e-6


@dataclass(frozen=True)
class _Unit:
    """Cells ``[lo, hi)`` of the sweep on the prompt batches ``parts``."""

    id: int
    lo: int
    hi: int
    parts: tuple[int, ...]


@dataclass
class _Slot:
    """One worker: its actor, whether it has loaded the model, what it runs."""

    index: int
    actor: Any
    placed_ref: Any = None
    ready_ref: Any = None
    placed: bool = False
    ready: bool = False
    created: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class RayExecutor:
    """Shards sweeps over Ray actors, one copy of the model per actor.

    Pass it as ``executor=`` to :func:`~gna_lens.ablation_sweep`,
    :func:`~gna_lens.interventions.control_sweep`, :func:`~gna_lens.score_heads` or
    :func:`gna_lens.scan.scan`. The actors start on the first sweep and stay up for the next
    ones (``score_heads`` runs two sweeps) until :meth:`close` (or the ``with`` block ends, or
    a sweep fails or is interrupted).

    Args:
        model_source: How a worker gets the model: ``None`` (default) re-creates it from its
            provenance (what :func:`gna_lens.load_model` loaded: the folder, the ``.gguf`` file,
            the zoo name, or the hub name at the recorded revision; in the model's current
            dtype); a name or folder for :func:`gna_lens.load_model`; or a function with no
            arguments returning the model (pickled to the workers; it places the model on its
            device). A model built in memory has no provenance: pass one of the others. Each
            worker checks that its copy has the caller's weights (a fingerprint of every
            parameter) and refuses to run otherwise.
        workers: Actors to start. Default: one per GPU of the cluster; without GPUs, one per
            ``threads_per_worker`` CPUs.
        threads_per_worker: Torch threads (and Ray CPUs) per actor. Default: the cluster's CPUs
            divided among ``workers`` (1 when ``workers`` is not given either), so the actors
            together do not oversubscribe the cores.
        gpus_per_worker: GPUs per actor (default 1 where the cluster has GPUs, else 0).
        address: A Ray cluster's address (``"auto"``, ``"ray://head:10001"``, ``"head:6379"``).
            Default: the Ray instance this process is connected to, else a new local one.
        max_restarts: Worker replacements allowed per sweep (all workers together).
        units_per_worker: Units of work per worker and prompt block (more: finer progress and
            less lost on a failure, slightly more overhead).
        start_timeout: Seconds to wait for a worker to start and load the model.
        place_timeout: Seconds to wait for Ray to place a worker (find its CPUs / GPUs) before
            the sweep stops and says which resources are missing (raise it on a cluster that
            adds nodes on demand).
        init_kwargs: Extra arguments of ``ray.init`` when this executor starts or joins Ray
            (see :func:`ray_init_kwargs`: a local instance it starts runs its workers at this
            process's niceness, not Ray's 15).

    Raises:
        ConfigError: For non-positive counts (here), and, on the first sweep, when Ray is not
            installed, the cluster lacks the CPUs or GPUs asked for, or the model cannot be
            re-created in a worker.

    Examples:
        A sweep on two local workers, each loading the model by its provenance (not run here:
        it starts Ray):

        ```python
        from gna_lens import ablation_sweep, load_model
        from gna_lens.distributed import RayExecutor

        model = load_model("smollm2-135m")
        with RayExecutor(workers=2) as ex:
            result = ablation_sweep(model, task, "logit_diff", executor=ex)
        result.info["executor"]  # workers, address, units, restarts, failures
        ```
    """

    def __init__(
        self,
        model_source: str | Path | Callable[[], Any] | None = None,
        *,
        workers: int | None = None,
        threads_per_worker: int | None = None,
        gpus_per_worker: float | None = None,
        address: str | None = None,
        max_restarts: int = 3,
        units_per_worker: int = 8,
        start_timeout: float = 900.0,
        place_timeout: float = 60.0,
        init_kwargs: dict[str, Any] | None = None,
    ):
        for name, value, least, auto in (
            ("workers", workers, 1, " or None (automatic)"),
            ("threads_per_worker", threads_per_worker, 1, " or None (automatic)"),
            ("max_restarts", max_restarts, 0, ""),
            ("units_per_worker", units_per_worker, 1, ""),
        ):
            if value is None and auto:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(
                    f"RayExecutor({name}={value!r}); expected an int >= {least}{auto}."
                )
        if gpus_per_worker is not None and not (
            isinstance(gpus_per_worker, int | float) and gpus_per_worker >= 0
        ):
            raise ConfigError(
                f"RayExecutor(gpus_per_worker={gpus_per_worker!r}); expected a number >= 0 or None."
            )
        if not (model_source is None or isinstance(model_source, str | Path)) and not callable(
            model_source
        ):
            raise ConfigError(
                f"RayExecutor(model_source={type(model_source).__name__}); expected None (from "
                "the model's provenance), a name or folder for load_model, or a function "
                "returning the model."
            )
        self.model_source = model_source
        self.workers = workers
        self.threads_per_worker = threads_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.address = address
        self.max_restarts = max_restarts
        self.units_per_worker = units_per_worker
        self.start_timeout = float(start_timeout)
        self.place_timeout = float(place_timeout)
        self.init_kwargs = dict(init_kwargs or {})
        self._slots: list[_Slot] = []
        self._pool_key: Any = None
        self._spec: dict[str, Any] = {}
        self._fp_cache: tuple[Any, tuple[int, float, float]] | None = None
        self._started_ray = False
        self._sweep_ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RayExecutor({self.describe()})"

    def describe(self) -> str:
        """One line: workers, threads or GPUs each, the cluster, where the model comes from."""
        spec = self._spec
        workers = spec.get("workers", self.workers or "auto")
        each = (
            f"{spec.get('gpus_per_worker')} GPU"
            if spec.get("gpus_per_worker")
            else f"{spec.get('threads_per_worker', self.threads_per_worker or 'auto')} CPU thread(s)"
        )
        where = spec.get("address") or self.address or "local Ray instance"
        source = spec.get("model_source", "from the model's provenance")
        return f"Ray: {workers} workers x {each} ({where}); model: {source}"

    def close(self) -> None:
        """Kill the workers (and shut down the Ray instance this executor started)."""
        self._kill_pool()
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def _kill_pool(self) -> None:
        if not self._slots:
            return
        import ray

        for slot in self._slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        self._slots = []
        self._pool_key = None

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError as err:
            raise ConfigError(
                f"RayExecutor needs Ray, which is not installed ({err}). Install the extra: "
                "pip install 'gna-lens[ray]'."
            ) from err
        if not ray.is_initialized():
            ray.init(**ray_init_kwargs(self.address, self.init_kwargs))
            self._started_ray = True
        return ray

    # ------------------------------------------------------------------ the model in a worker
    def _source(self, model: HookedModel) -> tuple[Any, dict[str, Any], str]:
        """(what a worker loads, load_model's keyword arguments, a description)."""
        groups = getattr(model, "head_group_spec", None)
        if groups:
            raise GnaLensError(
                f"RayExecutor: the model's heads are Mamba-1 channel groups ({groups!r}), which a "
                "worker's freshly loaded copy would not have, so its cells would address other "
                "channels. Fix: run this sweep without executor=, or with single channels "
                "(head_groups=None)."
            )
        dtype = _param_dtype(model)
        if self.model_source is not None and not isinstance(self.model_source, str | Path):
            name = getattr(self.model_source, "__qualname__", type(self.model_source).__name__)
            return self.model_source, {}, f"factory {name}()"
        if self.model_source is not None:
            src = _absolute(str(self.model_source))
            return src, {"dtype": dtype}, f"{src} ({_dtype_name(dtype)})"
        from gna_lens.models.provenance import provenance_of

        prov = provenance_of(model)
        if not prov.known:
            raise ConfigError(
                f"RayExecutor: this {type(model).__name__} was not loaded by "
                "gna_lens.load_model (its provenance is unknown), so a worker cannot re-create "
                "it. Fix: save it (model.save_pretrained / the Hugging Face model's) and pass "
                "RayExecutor(model_source=<that folder>), or pass model_source=<a function "
                "returning the model>."
            )
        kwargs: dict[str, Any] = {"dtype": dtype}
        if prov.source in ("gguf", "local") and prov.location:
            src = _absolute(prov.location)
        elif prov.source == "hub":
            src = prov.location or prov.name
            if prov.revision:
                kwargs["revision"] = prov.revision
        else:
            src = _absolute(prov.name)
        rev = f" at {kwargs['revision'][:12]}" if "revision" in kwargs else ""
        return src, kwargs, f"{src}{rev} ({_dtype_name(dtype)}, from the model's provenance)"

    def _resources(self, ray: Any) -> dict[str, Any]:
        total = ray.cluster_resources()
        cpus, gpus = int(total.get("CPU", 0)), float(total.get("GPU", 0))
        gpw = self.gpus_per_worker
        if gpw is None:
            gpw = 1 if gpus >= 1 else 0
        if gpw:
            workers = self.workers or max(1, int(gpus // gpw))
            threads = self.threads_per_worker or max(1, min(4, cpus // max(workers, 1)))
        else:
            threads = self.threads_per_worker or (
                max(1, cpus // self.workers) if self.workers else 1
            )
            workers = self.workers or max(1, cpus // threads)
        if workers * threads > cpus or workers * gpw > gpus:
            raise ConfigError(
                f"RayExecutor: {workers} workers x {threads} CPU(s)"
                + (f" and {gpw} GPU(s)" if gpw else "")
                + f" need {workers * threads} CPUs"
                + (f" and {workers * gpw:g} GPUs" if gpw else "")
                + f"; the Ray cluster has {cpus} CPUs and {gpus:g} GPUs. Fix: fewer workers or "
                "threads_per_worker, or a larger cluster."
            )
        return {"workers": workers, "threads_per_worker": threads, "gpus_per_worker": gpw}

    def _ensure_pool(
        self, ray: Any, model: HookedModel, source: Any, kwargs: Any, label: str
    ) -> None:
        fingerprint = self._fingerprint_of(model)
        key = (source if isinstance(source, str) else id(source), repr(kwargs), fingerprint)
        if self._slots and self._pool_key == key:
            return
        self._kill_pool()
        spec = self._resources(ray)
        try:
            address = ray.get_runtime_context().gcs_address
        except Exception:  # an older or client-mode runtime context
            address = self.address
        self._spec = spec | {"address": address, "model_source": label}
        self._remote = ray.remote(_SweepWorker).options(
            num_cpus=spec["threads_per_worker"],
            num_gpus=spec["gpus_per_worker"],
            max_restarts=0,
            max_concurrency=1,
        )
        self._worker_args = (source, kwargs, spec["threads_per_worker"], fingerprint, label)
        self._slots = [self._new_slot(i) for i in range(spec["workers"])]
        self._pool_key = key

    def _fingerprint_of(self, model: HookedModel) -> tuple[int, float, float]:
        """The weights' fingerprint, recomputed only when a parameter was replaced or edited in
        place since the last sweep (its storage or torch's version counter changed): summing
        every parameter of a large model takes a while, and it is serial time of every sweep."""
        state = _param_state(model)
        cached = self._fp_cache
        if state is not None and cached is not None and cached[0] == (id(model), state):
            return cached[1]
        fingerprint = _fingerprint(model)
        self._fp_cache = None if state is None else ((id(model), state), fingerprint)
        return fingerprint

    def _new_slot(self, index: int) -> _Slot:
        actor = self._remote.remote(*self._worker_args)
        return _Slot(index, actor, placed_ref=actor.placed.remote(), ready_ref=actor.load.remote())

    def start(self, model: HookedModel) -> "RayExecutor":
        """Start the workers for ``model`` and wait until each has loaded it (optional: the
        first sweep starts them otherwise, and begins as soon as one is ready).

        Returns:
            The executor.

        Raises:
            ConfigError: As the first sweep would (no Ray, too few resources, no provenance).
            WorkerError: If a worker cannot be placed or cannot load the model.
        """
        with self._pool(model) as ray:
            run = _Run(self, ray, None, [], [], [], -1, None)
            while not all(s.ready for s in self._slots):
                run.wait_once()
        return self

    @contextlib.contextmanager
    def _pool(self, model: HookedModel) -> Iterator[Any]:
        """Ray, with the workers for ``model`` started (or kept); on an error, a worker beyond
        repair or Ctrl-C in the block, every worker is stopped."""
        source, kwargs, label = self._source(model)  # refuse before starting anything
        ray = self._ray()
        self._ensure_pool(ray, model, source, kwargs, label)
        try:
            yield ray
        except BaseException:
            self._kill_pool()
            raise

    # ------------------------------------------------------------------ a sweep
    def run_sweep(
        self, model: HookedModel, job: Any, sweep: Any, *, bar: Any = None
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Run a planned sweep on the workers (called by the sweeps; see the module docs).

        Args:
            model: The caller's model (its provenance and weights fingerprint are read).
            job: The sweep's :class:`~gna_lens.interventions.engine.SweepJob`.
            sweep: The caller's plan (:class:`~gna_lens.interventions.engine.CellSweep`).
            bar: A tqdm bar, advanced by prompts x cells as units finish.

        Returns:
            ``(values [cell, sample], baseline [sample], info)``; ``info["executor"]`` records
            the workers, the cluster's address, the units, restarts and failures.

        Raises:
            WorkerError: When workers failed more than ``max_restarts`` times, could not load
                the model, or raised an unexpected error.
        """
        with self._pool(model) as ray:
            sweep_id = next(self._sweep_ids)
            batches = sweep.batches()
            units = plan_units(
                sweep.start_layers(), [len(b) for b in batches], sweep.batch_bytes(),
                sweep.plan.budget, len(self._slots) * self.units_per_worker,
                pack=sweep.plan.pack, per_layer=sweep.positions != "last",
            )  # fmt: skip
            return _Run(self, ray, sweep, batches, units, [ray.put(job)], sweep_id, bar).loop()

    def _unit_done(self, slot: _Slot, unit: _Unit) -> None:
        """Called after each finished unit (a hook for tests)."""


class _Run:
    """The scheduling loop of one sharded sweep."""

    def __init__(
        self,
        ex: RayExecutor,
        ray: Any,
        sweep: Any,
        batches: list[Tensor],
        units: list[_Unit],
        job_box: list[Any],
        sweep_id: int,
        bar: Any,
    ):
        self.ex, self.ray, self.sweep, self.batches = ex, ray, sweep, batches
        self.units, self.job_box, self.sweep_id, self.bar = units, job_box, sweep_id, bar
        n_cells, n = (len(sweep.cells), sweep.n_samples) if sweep is not None else (0, 0)
        self.values = host_full((n_cells, n))
        self.baseline = host_full(n)
        self.filled = torch.zeros((n_cells, n), dtype=torch.bool, device=HOST)
        self.spread = 0.0
        self.pending: deque[_Unit] = deque(units)
        self.in_flight: dict[Any, tuple[_Slot, _Unit]] = {}
        self.done: set[int] = set()
        self.restarts = 0
        self.reruns = 0
        self.failures: list[str] = []
        self.infos: list[dict[str, Any]] = []
        self.by_worker = [0] * len(ex._slots)
        self.busy = [0.0] * len(ex._slots)  # seconds each worker spent inside its units
        self.cpu = [0.0] * len(ex._slots)  # CPU seconds of each worker's process in them
        self.t0 = time.perf_counter()

    def samples(self, unit: _Unit) -> Tensor:
        return torch.cat([self.batches[p] for p in unit.parts])

    def loop(self) -> tuple[Tensor, Tensor, dict[str, Any]]:
        while len(self.done) < len(self.units):
            for slot in self.ex._slots:
                while slot.ready and slot.in_flight < IN_FLIGHT and self.pending:
                    unit = self.pending.popleft()
                    ref = slot.actor.run.remote(
                        self.sweep_id, self.job_box, unit.lo, unit.hi, unit.parts
                    )
                    self.in_flight[ref] = (slot, unit)
                    slot.in_flight += 1
            if not (self.in_flight or self.pending or any(not s.ready for s in self.ex._slots)):
                raise WorkerError(
                    f"internal: {len(self.units) - len(self.done)} units neither done nor queued"
                )
            self.wait_once()
        return self.result()

    def wait_once(self) -> None:
        """Wait for one event: a unit finished, or a worker placed or loaded."""
        ray = self.ray
        starting = {
            (s.ready_ref if s.placed else s.placed_ref): s for s in self.ex._slots if not s.ready
        }
        refs = list(self.in_flight) + list(starting)
        ready, _ = ray.wait(refs, num_returns=1, timeout=None if self.in_flight else 5.0)
        if not ready:
            self.check_stalled()
            return
        ref = ready[0]
        if ref in starting:
            self.started(starting[ref], ref)
        else:
            self.finished(ref)

    def check_stalled(self) -> None:
        """No worker is ready: stop if one cannot be placed or takes too long to load."""
        now = time.monotonic()
        spec = self.ex._spec
        for s in self.ex._slots:
            if not s.placed and now - s.created > self.ex.place_timeout:
                free = self.ray.available_resources()
                need = f"{spec['threads_per_worker']} CPU(s)" + (
                    f" and {spec['gpus_per_worker']:g} GPU(s)" if spec["gpus_per_worker"] else ""
                )
                raise WorkerError(
                    f"Ray could not place worker {s.index} within {self.ex.place_timeout:.0f} s: "
                    f"it needs {need}; free now: {free.get('CPU', 0):g} CPUs, "
                    f"{free.get('GPU', 0):g} GPUs. Another RayExecutor or Ray job may hold them "
                    "(close it), or ask for fewer workers; on a cluster that adds nodes, raise "
                    f"place_timeout. Cells not done: {self.cells_left()}."
                )
            if s.placed and now - s.created > self.ex.start_timeout:
                raise WorkerError(
                    f"worker {s.index} did not load the model from {spec.get('model_source')} "
                    f"within {self.ex.start_timeout:.0f} s (start_timeout); cells not done: "
                    f"{self.cells_left()}."
                )

    def started(self, slot: _Slot, ref: Any) -> None:
        try:
            info = self.ray.get(ref)
        except _failures() as err:
            self.failed(slot, err)
            return
        if not slot.placed:
            slot.placed = True
            return
        if info.get("error"):
            raise WorkerError(
                f"worker {slot.index} could not set up the model "
                f"({self.ex._spec.get('model_source')}): {info['error'].rstrip('.')}; cells "
                f"not done: {self.cells_left()}."
            )
        slot.ready, slot.ready_ref, slot.info = True, None, info

    def finished(self, ref: Any) -> None:
        from ray.exceptions import RayTaskError

        slot, unit = self.in_flight.pop(ref)
        slot.in_flight -= 1
        try:
            values, baseline, info = self.ray.get(ref)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, GnaLensError):
                raise cause from None  # the sweep's own inputs: as in one process
            if isinstance(cause, torch.OutOfMemoryError):
                self.failed(slot, cause, unit)
                return
            raise WorkerError(
                f"worker {slot.index} raised {type(cause or err).__name__} on cells "
                f"{self.label(unit.lo, unit.hi)}: {_first_lines(cause or err)}. The sweep "
                f"stopped; cells not done: {self.cells_left()}."
            ) from err
        except _failures() as err:
            self.failed(slot, err, unit)
            return
        if unit.id in self.done:  # cannot happen: a unit is in flight once at a time
            raise WorkerError(f"internal: unit {unit.id} finished twice")
        samples = self.samples(unit)
        rows = torch.arange(unit.lo, unit.hi, device=HOST)[:, None]
        if bool(self.filled[rows, samples[None, :]].any()):
            raise WorkerError(f"internal: cells {self.label(unit.lo, unit.hi)} computed twice")
        self.values[rows, samples[None, :]] = values
        self.filled[rows, samples[None, :]] = True
        known = ~torch.isnan(self.baseline[samples])
        if bool(known.any()):
            diff = (self.baseline[samples][known] - baseline[known]).abs().max()
            self.spread = max(self.spread, float(diff))
        self.baseline[samples] = torch.where(known, self.baseline[samples], baseline)
        self.busy[slot.index] += float(info.pop("unit_seconds", 0.0))
        self.cpu[slot.index] += float(info.pop("unit_cpu_seconds", 0.0))
        self.infos.append(info)
        self.done.add(unit.id)
        self.by_worker[slot.index] += 1
        if self.bar is not None:
            self.bar.update((unit.hi - unit.lo) * len(samples))
        self.ex._unit_done(slot, unit)

    def failed(self, slot: _Slot, err: BaseException, unit: _Unit | None = None) -> None:
        """Replace a dead worker; its unfinished units go back to the front of the queue."""
        lost = [unit] if unit is not None else []
        for ref, (s, u) in list(self.in_flight.items()):
            if s is slot:
                del self.in_flight[ref]
                lost.append(u)
        for u in sorted(lost, key=lambda u: u.id, reverse=True):
            self.pending.appendleft(u)
        self.reruns += len(lost)
        self.restarts += 1
        self.failures.append(f"worker {slot.index}: {type(err).__name__}: {_first_lines(err)}")
        if self.restarts > self.ex.max_restarts:
            raise WorkerError(
                f"the sweep stopped after {self.restarts} worker failures "
                f"(max_restarts={self.ex.max_restarts}); cells not done: {self.cells_left()}. "
                f"Last worker error (worker {slot.index}): {type(err).__name__}: "
                f"{_first_lines(err)}"
            ) from err
        with contextlib.suppress(Exception):
            self.ray.kill(slot.actor, no_restart=True)
        fresh = self.ex._new_slot(slot.index)
        fresh.info = slot.info  # the last load's, until the new actor has loaded
        self.ex._slots[slot.index] = fresh

    def label(self, lo: int, hi: int) -> str:
        cells = self.sweep.cells[lo:hi]
        # head cells are tuples of heads; layer, hook and patching cells carry their label
        names = [
            heads_label(c, "+") if isinstance(c, tuple) else (c.label or f"cell at layer {c.start}")
            for c in cells
        ]
        return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} cells)"

    def cells_left(self) -> str:
        if self.sweep is None:
            return "none (no sweep was running)"
        left = [u for u in self.units if u.id not in self.done]
        n_cells = len({i for u in left for i in range(u.lo, u.hi)})
        shown = ", ".join(self.label(u.lo, u.hi) for u in left[:8])
        more = f", and {len(left) - 8} more units" if len(left) > 8 else ""
        return f"{n_cells} of {len(self.sweep.cells)} cells in {len(left)} units: {shown}{more}"

    def result(self) -> tuple[Tensor, Tensor, dict[str, Any]]:
        if not bool(self.filled.all()):
            raise WorkerError("internal: the sharded sweep left cells without a value")
        info = _merge_infos(self.infos)
        spec = self.ex._spec
        info["executor"] = {
            "kind": "ray",
            "address": spec.get("address"),
            "workers": len(self.ex._slots),
            "threads_per_worker": spec.get("threads_per_worker"),
            "gpus_per_worker": spec.get("gpus_per_worker"),
            "model_source": spec.get("model_source"),
            "devices": [s.info.get("device") for s in self.ex._slots],
            "load_seconds": [s.info.get("load_seconds") for s in self.ex._slots],
            "units": len(self.units),
            "units_by_worker": list(self.by_worker),
            "wall_seconds": round(time.perf_counter() - self.t0, 3),
            "busy_seconds": [round(b, 3) for b in self.busy],
            "cpu_seconds": [round(c, 3) for c in self.cpu],
            "restarts": self.restarts,
            "reruns": self.reruns,
            "failures": list(self.failures),
            "baseline_spread": self.spread,
        }
        return self.values, self.baseline, info


# ----------------------------------------------------------------------------- the worker
class _SweepWorker:
    """A Ray actor: one copy of the model, and the plan of the sweep it is working on."""

    def __init__(
        self, source: Any, kwargs: dict[str, Any], threads: int, fingerprint: Any, label: str
    ):
        self.args = (source, kwargs, fingerprint, label)
        self.error: str | None = None
        self.session: tuple[int, Any, Any] | None = None
        self.model: HookedModel | None = None
        self.load_seconds = 0.0
        torch.set_num_threads(int(threads))

    def placed(self) -> int:
        """Answers as soon as Ray has placed the actor (before the model loads)."""
        return os.getpid()

    def load(self) -> dict[str, Any]:
        """Load the model and check its weights; the error, if any, is returned (and raised by
        every later call): a load that failed would fail again."""
        import ray

        source, kwargs, fingerprint, label = self.args
        t0 = time.perf_counter()
        gpus = ray.get_gpu_ids()
        self.device = "cuda" if gpus and torch.cuda.is_available() else "cpu"
        try:
            if callable(source):
                self.model = source()
            else:
                from gna_lens.models import load_model

                self.model = load_model(source, device=self.device, **kwargs)
            mine = _fingerprint(self.model)
            if not _same_fingerprint(mine, fingerprint):
                self.error = (
                    f"the model it loaded from {label} has other weights than the caller's "
                    f"(fingerprint {_fmt(mine)} vs {_fmt(fingerprint)}: parameter count, sum, "
                    "sum of absolute values). Was the model edited or cast after loading, or does "
                    "the name resolve to another copy on the workers? Fix: pass "
                    "RayExecutor(model_source=<a folder with exactly these weights>)."
                )
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
        self.load_seconds = round(time.perf_counter() - t0, 2)
        return {
            "error": self.error,
            "device": self.device,
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "load_seconds": self.load_seconds,
        }

    def run(
        self, sweep_id: int, job_box: list[Any], lo: int, hi: int, parts: tuple[int, ...]
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        import gna_lens.interventions  # noqa: F401  (registers every sweep's planner)
        from gna_lens.interventions.engine import plan_job

        if self.error:
            raise WorkerError(self.error)
        t0, c0 = time.perf_counter(), time.process_time()
        if self.session is None or self.session[0] != sweep_id:
            import ray

            self.session = None  # drop the last sweep's clean runs first
            assert self.model is not None  # a failed load raised its WorkerError above
            job = ray.get(job_box[0])
            with _context(job, self.device):
                self.session = (sweep_id, job, plan_job(self.model, job))
        _, job, sweep = self.session
        with _context(job, self.device):
            values, baseline, info = sweep.run(only=range(lo, hi), parts=parts, keep=True)
        batches = sweep.batches()
        samples = torch.cat([batches[p] for p in parts])
        info = info | {
            "unit_seconds": time.perf_counter() - t0,
            "unit_cpu_seconds": time.process_time() - c0,
        }
        return values[lo:hi][:, samples].clone(), baseline[samples].clone(), info


@contextlib.contextmanager
def _context(job: Any, device: str) -> Iterator[None]:
    """``torch.no_grad``, and the caller's autocast (``score_heads(sweep_dtype="bfloat16")``)."""
    with torch.no_grad(), autocast(device, job.autocast):
        yield


# ----------------------------------------------------------------------------- units
def ray_init_kwargs(address: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """``ray.init``'s arguments for :class:`RayExecutor` (``extra`` wins): no dashboard, and
    where a new local instance starts, its workers at this process's niceness.

    Ray starts workers at niceness 15, so beside any other busy process they get a few percent
    of a core (measured: about 4% each beside two CPU-bound processes) and a sweep stalls; at
    the caller's niceness they share the cores as the caller would.

    Examples:
        >>> ray_init_kwargs("auto", {})
        {'include_dashboard': False, 'address': 'auto'}
    """
    kwargs: dict[str, Any] = {"include_dashboard": False}
    if address is not None:
        kwargs["address"] = address
    elif not os.environ.get("RAY_ADDRESS"):  # a new local instance: its workers' priority
        kwargs["_system_config"] = {"worker_niceness": os.nice(0)}
    return kwargs | extra


def plan_units(
    start_layers: Sequence[int],
    batch_rows: Sequence[int],
    batch_bytes: Sequence[int],
    budget: int,
    target: int,
    pack: int | None = None,
    per_layer: bool = True,
) -> list[_Unit]:
    """Units of a sharded sweep: blocks of prompt batches whose clean runs fit ``budget``
    together (one block for most prompt sets), each split into about ``target`` contiguous cell
    ranges.

    A range ends where the cells' first ablated layer changes when that is near. With a pinned
    ``pack``, ranges end only where a chunk of ``pack`` cells would end in one process (within a
    layer's cells when ``per_layer``, the all-position path; else in the whole list, the
    last-position path), so each worker packs its cells exactly as one process does.

    Examples:
        >>> units = plan_units([0, 0, 0, 1, 1, 1, 2, 2], [4], [100], 10**9, 3)
        >>> [(u.lo, u.hi, u.parts) for u in units]
        [(0, 3, (0,)), (3, 6, (0,)), (6, 8, (0,))]
        >>> [(u.lo, u.hi) for u in plan_units([0] * 6 + [1] * 6, [4], [100], 10**9, 6, pack=4)]
        [(0, 4), (4, 6), (6, 10), (10, 12)]
    """
    blocks: list[list[int]] = []
    used = 0
    for part, size in enumerate(batch_bytes or [0] * len(batch_rows)):
        if not blocks or (used + size > budget and blocks[-1]):
            blocks.append([])
            used = 0
        blocks[-1].append(part)
        used += size
    ranges = _cell_ranges(list(start_layers), max(1, target), pack or 1, per_layer)
    units: list[_Unit] = []
    for block in blocks:
        for lo, hi in ranges:
            units.append(_Unit(len(units), lo, hi, tuple(block)))
    return units


def _cell_ranges(
    start: list[int], target: int, pack: int, per_layer: bool
) -> list[tuple[int, int]]:
    n = len(start)
    size = max(1, math.ceil(n / target))
    slack = size // 2
    out, lo, first = [], 0, 0  # first: where the current layer's cells begin
    for i in range(1, n):
        new_layer = start[i] != start[i - 1]
        if new_layer:
            first = i
        offset = (i - first) if per_layer else i
        if not (new_layer and per_layer) and offset % pack:
            continue  # not a chunk boundary of one process
        span = i - lo
        if span >= size and (new_layer or span >= size + slack):
            out.append((lo, i))
            lo = i
    if n:
        out.append((lo, n))
    return out


# ----------------------------------------------------------------------------- helpers
def _failures() -> tuple[type[BaseException], ...]:
    """Ray's errors of a worker that died or was lost (restart it and rerun its cells)."""
    from ray import exceptions as rex

    names = (
        "RayActorError",
        "WorkerCrashedError",
        "OutOfMemoryError",
        "NodeDiedError",
        "ObjectLostError",
        "LocalRayletDiedError",
    )
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def _merge_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One sweep's info from its units': counts summed, paths and fallbacks united."""
    out: dict[str, Any] = {"forwards": 0, "rows": 0, "incremental_fallbacks": 0, "expanded": False}
    paths: dict[str, list[str]] = {}
    fallbacks: list[str] = []
    for info in infos:
        for k in ("forwards", "rows", "incremental_fallbacks"):
            out[k] += int(info.get(k, 0))
        out["expanded"] = out["expanded"] or bool(info.get("expanded"))
        for step, taken in info.get("paths", {}).items():
            have = paths.setdefault(step, [])
            have.extend(p for p in taken if p not in have)
        fallbacks.extend(f for f in info.get("fallbacks", []) if f not in fallbacks)
    return out | {"paths": paths, "fallbacks": fallbacks}


def _param_dtype(model: HookedModel) -> torch.dtype:
    try:
        return cast("torch.dtype", next(iter(model.parameters())).dtype)
    except (StopIteration, AttributeError, TypeError):
        return torch.float32


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _absolute(path: str) -> str:
    """A path that exists here, made absolute (workers do not share the caller's directory)."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def _fingerprint(model: HookedModel) -> tuple[int, float, float]:
    """(parameter count, sum, sum of absolute values) over every parameter, in float64."""
    n, total, absolute = 0, 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            n += p.numel()
            total += float(p.sum(dtype=torch.float64))
            absolute += float(p.abs().sum(dtype=torch.float64))
    return n, total, absolute


def _param_state(model: HookedModel) -> tuple[tuple[Any, ...], ...] | None:
    """Per parameter: its storage, version counter (bumped by every in-place edit), shape and
    dtype: what tells that the weights may have changed without reading them. ``None`` when
    that cannot be told (inference-mode tensors keep no version counter)."""
    try:
        return tuple(
            (p.data_ptr(), p._version, tuple(p.shape), p.dtype, str(p.device))
            for p in model.parameters()
        )
    except (RuntimeError, AttributeError, TypeError):
        return None


def _same_fingerprint(a: Any, b: Any) -> bool:
    if a[0] != b[0]:
        return False
    scale = max(abs(a[2]), abs(b[2]), 1e-30)
    return all(abs(x - y) <= FINGERPRINT_RTOL * scale for x, y in zip(a[1:], b[1:], strict=True))


def _fmt(fp: Any) -> str:
    return f"({fp[0]}, {fp[1]:.6g}, {fp[2]:.6g})"


def _first_lines(err: BaseException, limit: int = 400) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
