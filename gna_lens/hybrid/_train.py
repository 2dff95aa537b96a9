"""The training loop of :func:`gna_lens.hybrid.distill` and :func:`gna_lens.hybrid.swap_heads`
(:func:`run_stages`): :class:`Stage` objects in order on one stream of texts, batched in order;
AdamW without weight decay, the learning rate warming up linearly over ``warmup`` steps, then a
cosine from ``lr`` to ``lr / 10`` over the stage's budget (the share of tokens read, or of the
time spent).

Checkpoints (``checkpoint_dir``): every ``checkpoint_every`` steps, at each stage's end and when
``max_steps`` stops a call, the trained parameters (safetensors), the optimizer's state and the
progress (stage, step, tokens, seconds, texts read, records; ``progress.json``, written last, so
an interrupted write leaves the previous checkpoint whole). A call with ``resume=True`` loads
them, skips the texts already read and goes on: with a token budget, it ends on the weights an
uninterrupted run ends on, bit for bit.

No step waits for the device: a step's losses stay on it as tensors and are read back together
(one synchronization) every :data:`LOG_EVERY` steps, at checkpoints and at each stage's end,
where the records are written, the progress bar shows the loss and the divergence check
(:func:`gna_lens.hybrid.distill`'s ``divergence_factor``) runs.
"""

import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gna_lens.device import HOST, to_host
from gna_lens.errors import ConfigError, DistillationDiverged
from gna_lens.hybrid._budget import Budget

__all__ = [
    "DIVERGENCE_FLOOR",
    "DIVERGENCE_WINDOW",
    "LOG_EVERY",
    "Loop",
    "Stage",
    "TrainState",
    "batches",
    "loss_stage",
    "run_stages",
]

Batch = tuple[Tensor, Tensor]
#: One step's losses to record: ``[(layer or None, loss), ...]``; a loss is a 0-d tensor left on
#: the device (read back at the next logging point) or a float.
StepLosses = list[tuple[int | None, Tensor | float]]

PROGRESS = "progress.json"
#: Steps between logging points (the losses read back from the device in one synchronization,
#: the progress bar's loss, the divergence check).
LOG_EVERY = 10
#: Steps whose mean loss the divergence check compares with the stage's starting loss.
DIVERGENCE_WINDOW = 5
#: The starting loss the divergence check scales is at least this (a stage that starts near
#: zero loss, e.g. a student that keeps every head, is not stopped for a rise to 0.01).
DIVERGENCE_FLOOR = 0.01


@dataclass
class Stage:
    """One stage of a run.

    Attributes:
        name: ``"stage1"``, ``"stage2"`` or ``"swap"``.
        params: ``(name, parameter)`` pairs it trains (the others stay frozen).
        step: ``step(ids, mask) -> losses``: forward, backward and clipping on one batch
            (its losses 0-d tensors left on the device, or floats: :data:`StepLosses`).
        probe: ``probe(ids, mask) -> loss`` without gradients, measured on the probe batch
            before and after the stage (``None``: not measured).
        budget: The stage's budget.
        lr: Peak learning rate.
        trained: What it trains, in words.
    """

    name: str
    params: list[tuple[str, nn.Parameter]]
    step: Callable[[Tensor, Tensor], StepLosses]
    probe: Callable[[Tensor, Tensor], float] | None
    budget: Budget
    lr: float
    trained: str


@dataclass(frozen=True)
class Loop:
    """The loop settings of :func:`run_stages` (:func:`~gna_lens.hybrid.distill`'s arguments of
    the same names), checked; ``where`` names the caller in errors."""

    where: str
    batch_size: int
    max_length: int
    warmup: int
    checkpoint_dir: str | Path | None
    resume: bool
    progress: bool
    max_steps: int | None
    checkpoint_every: int
    divergence_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "checkpoint_every", "max_steps"):
            value = getattr(self, name)
            if (name != "max_steps" or value is not None) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{self.where}({name}={value!r}); expected a positive int.")
        factor = self.divergence_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not 1 < factor < math.inf
        ):
            raise ConfigError(
                f"{self.where}(divergence_factor={factor!r}); expected a number above 1 (the "
                "rise over a stage's starting loss that stops it, e.g. 10.0) or None (no check)."
            )


def loss_stage(
    name: str,
    params: list[tuple[str, nn.Parameter]],
    loss: Callable[[Tensor, Tensor], Tensor],
    budget: Budget,
    lr: float,
    trained: str,
    grad_clip: float,
) -> Stage:
    """A stage whose step backpropagates ``loss(ids, mask)`` and clips the gradient of
    ``params`` to norm ``grad_clip``, and whose probe is the same loss without gradients."""

    def step(ids: Tensor, mask: Tensor) -> StepLosses:
        value = loss(ids, mask)
        value.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], grad_clip)
        return [(None, value.detach())]  # read back at the next logging point

    def probe(ids: Tensor, mask: Tensor) -> float:
        with torch.no_grad():
            return float(loss(ids, mask))

    return Stage(name, params, step, probe, budget, lr, trained)


@dataclass
class TrainState:
    """Where a run stands (what ``progress.json`` holds)."""

    stage: int = 0  # index into the run's stages
    step: int = 0  # optimizer steps in this stage
    tokens: int = 0  # tokens read in this stage
    seconds: float = 0.0  # seconds spent in this stage
    texts: int = 0  # texts read in the whole run
    records: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, dict[str, float]] = field(default_factory=dict)
    # per stage: tokens, seconds, steps
    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    complete: bool = False


def batches(
    texts: Iterable[Any], tokenizer: Any, batch_size: int, max_length: int, device: Any
) -> Iterator[tuple[Tensor, Tensor, int, int]]:
    """``(ids [batch, pos], mask [batch, pos], texts read, tokens)`` from ``texts``,
    right-padded, ``ids`` and ``mask`` on ``device`` (``tokens``, the mask's sum, counted on the
    host: no synchronization).

    Each text is tokenized with the tokenizer's special tokens and cut to ``max_length``;
    texts under two tokens are read but not used.

    Raises:
        ConfigError: For an item that is not a str.
    """
    pad = int(getattr(tokenizer, "pad_token_id", None) or 0)
    rows: list[list[int]] = []
    read = 0
    for index, text in enumerate(texts):
        read += 1
        if not isinstance(text, str):
            raise ConfigError(
                f"distillation data item {index} is a {type(text).__name__} ({str(text)[:60]!r}); "
                "expected texts (str), e.g. default_distill_data(tokenizer) or a list of str."
            )
        ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)[
            "input_ids"
        ]
        if len(ids) >= 2:
            rows.append(list(ids))
        if len(rows) == batch_size:
            L = max(len(r) for r in rows)
            out = torch.full((len(rows), L), pad, dtype=torch.long, device=HOST)
            mask = torch.zeros((len(rows), L), dtype=torch.bool, device=HOST)
            for i, r in enumerate(rows):
                out[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=HOST)
                mask[i, : len(r)] = True
            yield _to(out, device), _to(mask, device), read, sum(len(r) for r in rows)
            rows, read = [], 0


def _to(t: Tensor, device: Any) -> Tensor:
    """A batch on ``device``; to CUDA from pinned memory without waiting (a copy from pageable
    memory would synchronize the stream every step)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _lr(stage: Stage, step: int, fraction: float, warmup: int) -> float:
    ramp = min(1.0, (step + 1) / max(1, warmup))
    return stage.lr * ramp * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))


def _data_fingerprint(texts: Iterable[Any], n: int = 4) -> str:
    """SHA-256 (12 hex digits) of the first ``n`` texts: a resumed run must read the same data."""
    h = hashlib.sha256()
    for t in itertools.islice(texts, n):
        h.update(str(t).encode("utf-8", "replace") + b"\0")
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------- checkpoints
def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


def _save(
    folder: Path,
    model: nn.Module,
    names: list[str],
    opt: torch.optim.Optimizer | None,
    state: TrainState,
    fingerprint: dict[str, Any],
) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{state.stage}-{state.step}"
    params = dict(model.named_parameters())
    weights = {n: to_host(params[n]).contiguous() for n in names}
    wfile, ofile = f"weights-{tag}.safetensors", f"optimizer-{tag}.pt"
    _atomic_write(folder / wfile, lambda p: save_file(weights, p))
    if opt is not None:
        _atomic_write(folder / ofile, lambda p: torch.save(opt.state_dict(), p))
    data = {
        "fingerprint": fingerprint,
        "weights": wfile,
        "optimizer": ofile if opt is not None else None,
        **asdict(state),
    }
    text = json.dumps(data, indent=1) + "\n"
    _atomic_write(folder / PROGRESS, lambda p: Path(p).write_text(text, encoding="utf-8"))
    for old in [*folder.glob("weights-*.safetensors"), *folder.glob("optimizer-*.pt")]:
        if old.name not in (wfile, data["optimizer"]):
            old.unlink()


def _load(
    folder: Path, model: nn.Module, fingerprint: dict[str, Any]
) -> tuple[TrainState, dict[str, Any] | None] | None:
    """The saved state (weights copied into ``model``) and optimizer state, or ``None``."""
    from safetensors.torch import load_file

    path = folder / PROGRESS
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    saved = data.get("fingerprint", {})
    diff = sorted(k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k))
    if diff:
        shown = "; ".join(f"{k}: saved {saved.get(k)!r}, now {fingerprint.get(k)!r}" for k in diff)
        raise ConfigError(
            f"checkpoint_dir={str(folder)!r} holds a run with other settings ({shown}). Fix: the "
            "same arguments to resume it, resume=False to start over there, or another "
            "checkpoint_dir."
        )
    weights = load_file(str(folder / data["weights"]))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device))
    opt_state = None
    if data.get("optimizer"):
        opt_state = torch.load(str(folder / data["optimizer"]), weights_only=False)
    saved = {f.name: data[f.name] for f in fields(TrainState) if data.get(f.name) is not None}
    return TrainState(**saved), opt_state


# ----------------------------------------------------------------------------- the loop
@dataclass
class RunOutcome:
    """What :func:`run_stages` returns."""

    state: TrainState
    resumed_at: dict[str, Any] | None


class _Watch:
    """The divergence check of one stage (see ``divergence_factor`` of ``distill``)."""

    def __init__(self, stage: Stage, factor: float | None, start: float | None, where: str):
        self.stage, self.factor, self.start, self.where = stage, factor, start, where
        self.origin = f"on the probe batch before {stage.name}"
        self.recent: list[float] = []

    def see(self, step: int, loss: float, probe: str | None = None) -> None:
        """Check the loss of ``step`` (the mean over its records), or a probe loss (``probe``
        says which)."""
        if self.factor is None:
            return
        if probe is None:
            self.recent = [*self.recent, loss][-DIVERGENCE_WINDOW:]
            current = sum(self.recent) / len(self.recent)
            if self.start is None:  # a stage without a probe: its first step
                self.start, self.origin = loss, f"at step {step}"
            first = step - len(self.recent) + 1
            what = f"mean of steps {first}-{step}" if first < step else f"step {step}"
        else:
            current, what = loss, probe
        limit = self.factor * max(self.start or 0.0, DIVERGENCE_FLOOR)
        if math.isfinite(loss) and (self.start is None or current <= limit):
            return
        name, lr = self.stage.name, self.stage.lr
        start = "nan" if self.start is None else f"{self.start:.4g}"
        if math.isfinite(loss):
            rise = (
                f"its loss rose to {current:.4g} ({what}), more than divergence_factor="
                f"{self.factor:g} times its starting loss {start} ({self.origin})"
            )
        else:
            what = probe or f"step {step}"
            rise = f"its loss is {loss} ({what}), not finite; it started at {start} ({self.origin})"
        raise DistillationDiverged(
            f"{self.where}: {name} diverged at step {step}: {rise}. The run stops here instead "
            f"of training on. Fix: a lower learning rate ({name} peak lr={lr:g}) or a longer "
            "warm-up; with autocast='bfloat16', check the same run in float32 (autocast=None); "
            "divergence_factor=None turns the check off."
        )


def _flush(
    pending: list[tuple[dict[str, Any], StepLosses]],
    records: list[dict[str, Any]],
    watch: _Watch,
    bar: Any,
) -> None:
    """Read the pending steps' losses back (one synchronization), record them, check them."""
    flat = [v for _, losses in pending for _, v in losses]
    on_device = [v for v in flat if isinstance(v, Tensor)]
    stacked = [v.detach().float().reshape(()) for v in on_device]
    read = iter(to_host(torch.stack(stacked)).tolist() if stacked else [])
    mean = math.nan
    for record, losses in pending:
        values = [next(read) if isinstance(v, Tensor) else float(v) for _, v in losses]
        for (layer, _), value in zip(losses, values, strict=True):
            records.append(record | {"layer": layer, "loss": value})
        mean = sum(values) / max(1, len(values))
        watch.see(record["step"], mean)
    pending.clear()
    if math.isfinite(mean):
        bar.set_postfix(loss=f"{mean:.4f}", refresh=False)


def run_stages(
    model: nn.Module,
    stages: list[Stage],
    data: Iterable[Any],
    tokenizer: Any,
    loop: Loop,
    *,
    fingerprint: dict[str, Any],
    device: Any,
) -> RunOutcome:
    """Run ``stages`` in order on the text stream ``data`` (see the module docstring).

    Raises:
        DistillationDiverged: With ``loop.divergence_factor`` set, for a stage whose loss rises
            above ``divergence_factor`` times its start or is not finite (``loop.where`` names
            the caller in the message).
    """
    from tqdm.auto import tqdm

    folder = Path(loop.checkpoint_dir) if loop.checkpoint_dir is not None else None
    union = list(dict.fromkeys(n for s in stages for n, _ in s.params))

    def save(opt: torch.optim.Optimizer | None) -> None:
        if folder is not None:
            _save(folder, model, union, opt, state, fingerprint)

    # The probe batch is the stream's first batch (measured before and after each stage, and
    # trained on like the others); the texts it took are put back in front of the stream.
    source = iter(data)
    taken: list[Any] = []

    def reading() -> Iterator[Any]:
        for text in source:
            taken.append(text)
            yield text

    first = next(batches(reading(), tokenizer, loop.batch_size, loop.max_length, device), None)
    if first is None:
        raise ConfigError(
            f"the training data gave no batch of {loop.batch_size} texts of two tokens or more "
            f"(read {len(taken)} texts)."
        )
    probe_batch: Batch = (first[0], first[1])
    fingerprint = fingerprint | {"data": _data_fingerprint(taken)}
    loaded = _load(folder, model, fingerprint) if folder is not None and loop.resume else None
    state, opt_state = loaded or (TrainState(), None)
    where = {"stage": state.stage, "step": state.step, "texts": state.texts}
    resumed_at = where if loaded is not None else None
    if state.complete:
        return RunOutcome(state, resumed_at)
    stream = itertools.chain(taken, source)
    for _ in range(state.texts):  # texts read before the checkpoint
        if next(stream, None) is None:
            raise ConfigError(
                f"the training data has fewer texts than the checkpoint had read ({state.texts}); "
                "resume with the same data."
            )
    feed = batches(stream, tokenizer, loop.batch_size, loop.max_length, device)
    all_params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in all_params.items()}
    steps_this_call = 0
    stopped = False
    # Steps whose losses are still on the device: (record without its loss, the step's losses).
    pending: list[tuple[dict[str, Any], StepLosses]] = []
    try:
        while state.stage < len(stages):
            stage = stages[state.stage]
            records = state.records
            trainable = {n for n, _ in stage.params}
            for n, p in all_params.items():
                p.requires_grad_(n in trainable)
            opt = torch.optim.AdamW(
                [p for _, p in stage.params], lr=stage.lr, betas=(0.9, 0.98), weight_decay=0.0
            )
            if opt_state is not None:
                opt.load_state_dict(opt_state)
                opt_state = None
            probe = state.probe.setdefault(stage.name, {})
            if stage.probe is not None and "before" not in probe:
                probe["before"] = stage.probe(*probe_batch)
            watch = _Watch(stage, loop.divergence_factor, probe.get("before"), loop.where)
            b = stage.budget
            total = b.tokens if b.tokens is not None else b.seconds
            bar = tqdm(
                total=total,
                initial=state.tokens if b.tokens is not None else int(state.seconds),
                desc=f"{stage.name} ({stage.trained})"[:60],
                unit="tok" if b.tokens is not None else "s",
                disable=not loop.progress,
                mininterval=2,
            )

            t0 = time.perf_counter() - state.seconds
            try:
                while not b.spent(state.tokens, state.seconds):
                    if loop.max_steps is not None and steps_this_call >= loop.max_steps:
                        stopped = True
                        break
                    got = next(feed, None)
                    if got is None:
                        raise ConfigError(
                            f"the distillation data ran out after {state.texts} texts, before "
                            f"the budget ({stage.name}: {b.describe()}). Fix: more texts, an "
                            "endless iterable (default_distill_data), or a smaller budget."
                        )
                    ids, mask, read, n_tok = got
                    fraction = b.fraction(state.tokens, state.seconds)
                    lr = _lr(stage, state.step, fraction, loop.warmup)
                    for g in opt.param_groups:
                        g["lr"] = lr
                    losses = stage.step(ids, mask)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    state.step += 1
                    state.tokens += n_tok
                    state.texts += read
                    state.seconds = time.perf_counter() - t0
                    steps_this_call += 1
                    record = {
                        "stage": stage.name,
                        "step": state.step,
                        "layer": None,
                        "loss": None,
                        "tokens": state.tokens,
                        "seconds": round(state.seconds, 3),
                        "lr": lr,
                        "trained": stage.trained,
                    }
                    pending.append((record, losses))
                    done = state.tokens if b.tokens is not None else state.seconds
                    bar.update(int(min(done, total or 0)) - bar.n)
                    if folder is not None and state.step % loop.checkpoint_every == 0:
                        _flush(pending, records, watch, bar)
                        save(opt)
                    elif state.step % LOG_EVERY == 0:
                        _flush(pending, records, watch, bar)
                _flush(pending, records, watch, bar)
            finally:
                bar.close()
            if stopped:
                save(opt)
                break
            state.seconds = time.perf_counter() - t0  # after the read-back: the device's time
            if stage.probe is not None:
                probe["after"] = stage.probe(*probe_batch)
                watch.see(state.step, probe["after"], f"on the probe batch after {stage.name}")
            state.totals[stage.name] = {
                "tokens": state.tokens,
                "seconds": round(state.seconds, 3),
                "steps": state.step,
            }
            state.stage += 1
            state.step, state.tokens, state.seconds = 0, 0, 0.0
            state.complete = state.stage == len(stages)
            save(None)
    finally:
        for n, p in all_params.items():
            p.requires_grad_(flags[n])
    return RunOutcome(state, resumed_at)
