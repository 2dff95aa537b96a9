"""The training loop shared by :func:`gna_lens.hybrid.distill` and
:func:`gna_lens.hybrid.swap_heads`: stages under a budget, progress bars, checkpoints and
resume.

A run is a list of :class:`Stage` objects, each with the parameters it trains, a step function
(forward, backward, gradient clipping; it returns the losses to record), a budget and a learning
rate. Texts come from one stream for the whole run, batched in order. The learning rate warms up
linearly over ``warmup`` steps, then follows a cosine from ``lr`` to ``lr / 10`` over the stage's
budget (the share of tokens read, or of the time spent). AdamW, no weight decay.

Checkpoints (``checkpoint_dir``): every ``checkpoint_every`` steps, at each stage's end and when
``max_steps`` stops a call, the trained parameters (safetensors), the optimizer's state and the
progress (stage, step, tokens, seconds, texts read, records; ``progress.json``, written last, so
an interrupted write leaves the previous checkpoint whole). A call with ``resume=True`` loads
them, skips the texts already read and goes on: with a token budget, it ends on the weights an
uninterrupted run ends on, bit for bit.
"""

import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gna_lens.errors import ConfigError
from gna_lens.hybrid._budget import Budget

__all__ = ["Stage", "TrainState", "batches", "run_stages"]

Batch = tuple[Tensor, Tensor]
#: One step's losses to record: ``[(layer or None, loss), ...]``.
StepLosses = list[tuple[int | None, float]]

PROGRESS = "progress.json"


@dataclass
class Stage:
    """One stage of a run.

    Attributes:
        name: ``"stage1"``, ``"stage2"`` or ``"swap"``.
        params: ``(name, parameter)`` pairs it trains (the others stay frozen).
        step: ``step(ids, mask) -> losses``: forward, backward and clipping on one batch.
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


@dataclass
class TrainState:
    """Where a run stands (what ``progress.json`` holds)."""

    stage: int = 0  # index into the run's stages
    step: int = 0  # optimizer steps in this stage
    tokens: int = 0  # tokens read in this stage
    seconds: float = 0.0  # seconds spent in this stage
    texts: int = 0  # texts read in the whole run
    records: list[dict[str, Any]] | None = None
    probe: dict[str, dict[str, float]] | None = None
    totals: dict[str, dict[str, float]] | None = None  # per stage: tokens, seconds, steps
    complete: bool = False

    def __post_init__(self) -> None:
        self.records = self.records or []
        self.probe = self.probe or {}
        self.totals = self.totals or {}


def batches(
    texts: Iterable[Any], tokenizer: Any, batch_size: int, max_length: int, device: Any
) -> Iterator[tuple[Tensor, Tensor, int]]:
    """``(ids [batch, pos], mask [batch, pos], texts read)`` from ``texts``, right-padded.

    Each text is tokenized with the tokenizer's special tokens and cut to ``max_length``;
    texts under two tokens are read but not used.

    Raises:
        ConfigError: For an item that is not a str.
    """
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
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
            out = torch.full((len(rows), L), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), L), dtype=torch.bool)
            for i, r in enumerate(rows):
                out[i, : len(r)] = torch.tensor(r)
                mask[i, : len(r)] = True
            yield out.to(device), mask.to(device), read
            rows, read = [], 0


def _lr(stage: Stage, step: int, fraction: float, warmup: int) -> float:
    ramp = min(1.0, (step + 1) / max(1, warmup))
    return stage.lr * ramp * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * fraction)))


def data_fingerprint(texts: Iterable[Any], n: int = 4) -> str:
    """SHA-256 (12 hex digits) of the first ``n`` texts: a resumed run must read the same data."""
    h = hashlib.sha256()
    for i, t in enumerate(texts):
        if i >= n:
            break
        h.update(str(t).encode("utf-8", "replace") + b"\0")
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------- checkpoints
def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
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
    weights = {n: params[n].detach().cpu().contiguous() for n in names}
    wfile, ofile = f"weights-{tag}.safetensors", f"optimizer-{tag}.pt"
    _atomic_write(folder / wfile, lambda p: save_file(weights, p))
    if opt is not None:
        _atomic_write(folder / ofile, lambda p: torch.save(opt.state_dict(), p))
    data = {
        "fingerprint": fingerprint,
        "weights": wfile,
        "optimizer": ofile if opt is not None else None,
        "stage": state.stage,
        "step": state.step,
        "tokens": state.tokens,
        "seconds": state.seconds,
        "texts": state.texts,
        "records": state.records,
        "probe": state.probe,
        "totals": state.totals,
        "complete": state.complete,
    }
    text = json.dumps(data, indent=1) + "\n"

    def write_progress(p: str) -> None:
        Path(p).write_text(text, encoding="utf-8")

    _atomic_write(folder / PROGRESS, write_progress)
    for old in folder.glob("weights-*.safetensors"):
        if old.name != wfile:
            old.unlink()
    for old in folder.glob("optimizer-*.pt"):
        if old.name != data["optimizer"]:
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
    state = TrainState(
        stage=int(data["stage"]),
        step=int(data["step"]),
        tokens=int(data["tokens"]),
        seconds=float(data["seconds"]),
        texts=int(data["texts"]),
        records=list(data["records"]),
        probe=dict(data["probe"]),
        totals=dict(data.get("totals") or {}),
        complete=bool(data["complete"]),
    )
    return state, opt_state


# ----------------------------------------------------------------------------- the loop
@dataclass
class RunOutcome:
    """What :func:`run_stages` returns."""

    state: TrainState
    resumed_at: dict[str, Any] | None
    stopped_early: bool


def run_stages(
    model: nn.Module,
    stages: list[Stage],
    data: Iterable[Any],
    tokenizer: Any,
    *,
    batch_size: int,
    max_length: int,
    warmup: int,
    checkpoint_dir: str | Path | None,
    resume: bool,
    progress: bool,
    max_steps: int | None,
    checkpoint_every: int,
    fingerprint: dict[str, Any],
    device: Any,
) -> RunOutcome:
    """Run ``stages`` in order on the text stream ``data`` (see the module docstring)."""
    from tqdm.auto import tqdm

    folder = Path(checkpoint_dir) if checkpoint_dir is not None else None
    union = list(dict.fromkeys(n for s in stages for n, _ in s.params))
    # The probe batch is the stream's first batch (measured before and after each stage, and
    # trained on like the others); the texts it took are put back in front of the stream.
    source = iter(data)
    taken: list[Any] = []

    def reading() -> Iterator[Any]:
        for text in source:
            taken.append(text)
            yield text

    first = next(batches(reading(), tokenizer, batch_size, max_length, device), None)
    if first is None:
        raise ConfigError(
            f"the training data gave no batch of {batch_size} texts of two tokens or more "
            f"(read {len(taken)} texts)."
        )
    probe_batch: Batch = (first[0], first[1])
    fingerprint = fingerprint | {"data": data_fingerprint(taken)}
    state = TrainState()
    opt_state: dict[str, Any] | None = None
    resumed_at = None
    if folder is not None and resume:
        loaded = _load(folder, model, fingerprint)
        if loaded is not None:
            state, opt_state = loaded
            resumed_at = {"stage": state.stage, "step": state.step, "texts": state.texts}
    if state.complete:
        return RunOutcome(state, resumed_at, False)
    stream = itertools.chain(taken, source)
    for _ in range(state.texts):  # texts read before the checkpoint
        if next(stream, None) is None:
            raise ConfigError(
                f"the training data has fewer texts than the checkpoint had read ({state.texts}); "
                "resume with the same data."
            )
    feed = batches(stream, tokenizer, batch_size, max_length, device)
    all_params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in all_params.items()}
    steps_this_call = 0
    stopped = False
    try:
        while state.stage < len(stages):
            stage = stages[state.stage]
            assert state.probe is not None and state.records is not None
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
            b = stage.budget
            total = b.tokens if b.tokens is not None else b.seconds
            bar = tqdm(
                total=total,
                initial=state.tokens if b.tokens is not None else int(state.seconds),
                desc=f"{stage.name} ({stage.trained})"[:60],
                unit="tok" if b.tokens is not None else "s",
                disable=not progress,
                mininterval=2,
            )
            t0 = time.perf_counter() - state.seconds
            while not b.spent(state.tokens, state.seconds):
                if max_steps is not None and steps_this_call >= max_steps:
                    stopped = True
                    break
                got = next(feed, None)
                if got is None:
                    raise ConfigError(
                        f"the distillation data ran out after {state.texts} texts, before the "
                        f"budget ({stage.name}: {b.describe()}). Fix: more texts, an endless "
                        "iterable (default_distill_data), or a smaller budget."
                    )
                ids, mask, read = got
                fraction = b.fraction(state.tokens, state.seconds)
                lr = _lr(stage, state.step, fraction, warmup)
                for g in opt.param_groups:
                    g["lr"] = lr
                losses = stage.step(ids, mask)
                opt.step()
                opt.zero_grad(set_to_none=True)
                n_tok = int(mask.sum())
                before = state.tokens
                state.step += 1
                state.tokens += n_tok
                state.texts += read
                state.seconds = time.perf_counter() - t0
                steps_this_call += 1
                for layer, loss in losses:
                    state.records.append(
                        {
                            "stage": stage.name,
                            "step": state.step,
                            "layer": layer,
                            "loss": loss,
                            "tokens": state.tokens,
                            "seconds": round(state.seconds, 3),
                            "lr": lr,
                            "trained": stage.trained,
                        }
                    )
                if b.tokens is not None:
                    bar.update(min(state.tokens, b.tokens) - min(before, b.tokens))
                else:
                    bar.n = int(min(state.seconds, total or 0))
                    bar.refresh()
                mean = sum(v for _, v in losses) / max(1, len(losses))
                bar.set_postfix(loss=f"{mean:.4f}", refresh=False)
                if folder is not None and state.step % checkpoint_every == 0:
                    _save(folder, model, union, opt, state, fingerprint)
            bar.close()
            if stopped:
                if folder is not None:
                    _save(folder, model, union, opt, state, fingerprint)
                break
            if stage.probe is not None:
                probe["after"] = stage.probe(*probe_batch)
            assert state.totals is not None
            state.totals[stage.name] = {
                "tokens": state.tokens,
                "seconds": round(state.seconds, 3),
                "steps": state.step,
            }
            state.stage += 1
            state.step, state.tokens, state.seconds = 0, 0, 0.0
            if state.stage == len(stages):
                state.complete = True
            if folder is not None:
                _save(folder, model, union, None, state, fingerprint)
    finally:
        for n, p in all_params.items():
            p.requires_grad_(flags[n])
    return RunOutcome(state, resumed_at, stopped)
