"""Forward passes that reuse what an intervention cannot change.

Two kinds of reuse, for both model kinds (TransformerBridge, HookedSSM):

- :meth:`Runner.from_layer`: an edit at layer ``l`` leaves the residual stream below ``l``
  unchanged, so runs start from the cached ``hook_resid_pre`` of layer ``l``. HookedSSM skips the
  lower blocks with ``start_at_layer``. TransformerBridge 4.3's ``start_at_layer`` still executes
  blocks ``0..l-1`` (it discards their output), so instead the bridge runs *one* row of tokens and
  a hook on ``blocks.{l}.hook_resid_pre`` swaps in the cached residual of every packed row: the
  lower blocks run on one row instead of all of them. The swap is checked once per model against
  ``start_at_layer`` and dropped if it does not match.
- A shared prefix (:class:`SharedPrefix`): where every row of a packed run starts with the same
  tokens and each cell's edit is the same on every row (zero or mean ablation), those positions
  run once per cell, not once per row: a first pass fills the Hugging Face KV cache of the
  prefix (one row per cell), and the rest of the prompts run on it (bridge only; checked once
  per model against the plain run, recorded under ``"prefix"``).
- :meth:`Runner.prefix` / :meth:`Runner.step`: an edit at the final position only leaves every
  earlier position unchanged, so the prompt minus its last token runs once; each edit then
  recomputes only the last token: from the Hugging Face KV cache (bridge) or from the SSM states,
  convolution windows and attention keys/values of the prefix (HookedSSM's own
  ``prefix_state`` / ``step``, built from its mixers' single-token steps). The step is checked
  against the full forward on every group; on a mismatch the caller falls back to full
  recomputation.

Only the logits at the last position are computed where the model allows it (HookedSSM: final
norm and unembedding on one position; bridge: ``logits_to_keep=1``).

Fallbacks are narrow and never silent: only :class:`ShortcutNotApplicable` selects the plain
path, and every runner keeps a :class:`PathLog` of the paths it took and of each fallback with its
reason (``info["paths"]``, ``info["fallbacks"]``).
"""

import copy
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from gna_lens.device import exact_matmul
from gna_lens.errors import InterventionError
from gna_lens.heads import Subject
from gna_lens.interventions.hooks import bind, hooked

Hooks = Sequence[tuple[Any, Callable[..., Any]]]

# Verdicts of the shortcuts, per model: ``None`` = the shortcut applies, else why it does not.
# Per bridge model: does swapping the residual at blocks.{l}.hook_resid_pre match start_at_layer?
_INJECT_VERDICT: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()
# Per model: does keeping only the last position after the last block's mixer match?
# (per number of kept positions: a bridge whose residual add broadcasts passes for 1, not for more)
_TAIL_VERDICT: "weakref.WeakKeyDictionary[Any, dict[int, str | None]]" = weakref.WeakKeyDictionary()
# Per bridge model: does running the rows' shared prefix once per cell (KV cache) match?
_PREFIX_VERDICT: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()
STEP_RTOL = 1e-4


@dataclass(frozen=True)
class SharedPrefix:
    """The first ``length`` positions hold the same tokens in every row of a packed run of
    ``cells`` cells (cell-major, equal rows per cell), and each cell edits them alike on its rows.

    Attributes:
        length: Shared positions (at least one position of every row is left after them).
        cells: Cells packed in the run.
        prefix_hooks: The cells' edits on ``cells`` rows (one per cell) of the shared positions.
        suffix_hooks: The cells' edits on the packed rows of the positions after them.
    """

    length: int
    cells: int
    prefix_hooks: "Hooks"
    suffix_hooks: "Hooks"


class ShortcutNotApplicable(Exception):
    """A fast path does not apply to this model or input: the caller takes the plain path.

    The only exception that selects a slower path; its message is recorded as the fallback's
    reason (:class:`PathLog`). It never reaches users.
    """


@contextmanager
def shortcut_run(what: str) -> Iterator[None]:
    """Run the model for a shortcut: a torch ``RuntimeError`` (a shape or layout the shortcut
    assumed and the model does not accept) means the shortcut does not apply.

    Out-of-memory errors, gna_lens errors (``ValueError``), ``TypeError``, ``KeyError`` and every
    other exception propagate.
    """
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:
        raise ShortcutNotApplicable(f"{what} raised RuntimeError: {err}") from err


class PathLog:
    """Which path computed what, and every fallback with its reason (deduplicated)."""

    def __init__(self) -> None:
        self.paths: dict[str, list[str]] = {}
        self.fallbacks: list[str] = []

    def used(self, step: str, path: str) -> None:
        """Record that ``step`` (e.g. ``"from_layer"``) ran on ``path``."""
        taken = self.paths.setdefault(step, [])
        if path not in taken:
            taken.append(path)

    def fell_back(self, step: str, path: str, reason: str | None) -> None:
        """Record that ``step`` ran on ``path`` because its shortcut did not apply (``reason``;
        ``None``: no shortcut was tried, as ``used``)."""
        self.used(step, path)
        if reason is None:
            return
        entry = f"{step}: {path} ({reason})"
        if entry not in self.fallbacks:
            self.fallbacks.append(entry)

    @staticmethod
    def merged(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The ``paths`` and ``fallbacks`` of several results' ``info`` as one (in order)."""
        log = PathLog()
        for info in infos:
            for step, taken in info.get("paths", {}).items():
                for path in taken:
                    log.used(step, path)
            for entry in info.get("fallbacks", []):
                if entry not in log.fallbacks:
                    log.fallbacks.append(entry)
        return log.as_info()

    def as_info(self) -> dict[str, Any]:
        """``{"paths": {step: [path, ...]}, "fallbacks": [str, ...]}`` for a result's ``info``."""
        return {
            "paths": {k: list(v) for k, v in self.paths.items()},
            "fallbacks": list(self.fallbacks),
        }


def _mismatch(fast: Tensor | None, slow: Tensor, rtol: float, what: str) -> str | None:
    """``None`` if the shortcut's result ``fast`` matches the plain ``slow`` one, else why not."""
    if fast is None:
        return None
    if fast.shape != slow.shape:
        return f"{what} gave shape {tuple(fast.shape)}, the plain path {tuple(slow.shape)}"
    if not _close(fast, slow, rtol):
        diff = float((fast.float() - slow.float()).abs().max())
        return f"{what} does not reproduce the plain path (max abs diff {diff:.2e})"
    return None


#: Relative tolerance of those checks while a bfloat16/float16 autocast is active: the shortcuts
#: are exact in exact arithmetic, but reordered half-precision products differ by ~1e-2.
AUTOCAST_RTOL = 3e-2


def autocast_dtype() -> torch.dtype | None:
    """The autocast dtype in effect (CPU or CUDA), or ``None``."""
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                return torch.get_autocast_dtype(device)
        except (RuntimeError, TypeError):  # older torch or a device type it does not know
            continue
    return None


def _close(a: Tensor, b: Tensor, rtol: float = STEP_RTOL) -> bool:
    if autocast_dtype() is not None:
        rtol = max(rtol, AUTOCAST_RTOL)
    a, b = a.float(), b.float()
    scale = float(b.abs().max()) + 1e-6
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= rtol * scale


class Runner:
    """Forward passes of one model for the interventions (always under ``torch.no_grad``)."""

    def __init__(self, subject: Subject, keep: int = 1):
        self.subject = subject
        model = self.model = subject.model
        self.view = subject.view
        self.n_layers = subject.view.n_layers
        self.is_ssm = subject.is_ssm
        #: How many trailing positions' logits every method returns: 1 gives ``[rows, d_vocab]``
        #: (the query position), ``keep > 1`` gives ``[rows, keep, d_vocab]`` (metrics over several
        #: positions, e.g. the next-token loss of a control text).
        self.keep = keep
        #: The paths taken and the fallbacks, for the result's ``info``.
        self.log = PathLog()
        self.keep_last: dict[str, Any] = {}
        if not self.is_ssm:
            hf = getattr(model, "original_model", None)
            try:
                params = inspect.signature(hf.forward).parameters if hf is not None else {}
            except (TypeError, ValueError):
                params = {}
            if "logits_to_keep" in params:
                self.keep_last = {"logits_to_keep": keep}
        # The last block's MLP (and anything position-wise after its mixer) only matters at the
        # kept positions: truncate the sequence there (checked once per model).
        tail = f"blocks.{self.n_layers - 1}.hook_resid_mid"

        def last_positions(x: Tensor, hook: Any) -> Tensor:
            return x[:, -keep:]

        self.tail_hooks: list[tuple[str, Callable[..., Any]]] = (
            [(tail, last_positions)] if tail in getattr(model, "hook_dict", {}) else []
        )

    # ------------------------------------------------------------------ full runs
    def _tail(self) -> list[tuple[str, Callable[..., Any]]]:
        """The truncation hooks where verified for this model (recorded either way)."""
        if not self.tail_hooks:
            return []
        verdicts = _TAIL_VERDICT.get(self.model, {})
        if self.keep not in verdicts or verdicts[self.keep] is not None:
            self.log.fell_back("tail", "every position", verdicts.get(self.keep))
            return []
        self.log.used("tail", f"last {self.keep} position(s)")
        return self.tail_hooks

    def _pick(self, logits: Tensor) -> Tensor:
        """The positions this runner returns: the last (``keep == 1``) or the last ``keep``."""
        return logits[:, -1] if self.keep == 1 else logits[:, -self.keep :]

    def logits_last(self, tokens: Tensor, hooks: Hooks = ()) -> Tensor:
        """Logits at the last position ``[rows, d_vocab]`` of a full forward with ``hooks``."""
        model = self.model
        with hooked(model, list(hooks) + self._tail()):
            if self.is_ssm:
                resid = model(tokens, stop_at_layer=self.n_layers)
            else:
                return self._pick(model(tokens, **self.keep_last))
        return self._final(resid)

    def _final(self, resid: Tensor) -> Tensor:
        """HookedSSM: final norm and unembedding of the kept positions only."""
        return self._pick(self.model(resid[:, -self.keep :], start_at_layer=self.n_layers))

    def clean(
        self, tokens: Tensor, names: Sequence[str], hooks: Hooks = ()
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """A run keeping the activations ``names`` (clean, or with ``hooks`` that every run of
        a sweep has); returns (last logits, activations)."""
        cache: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any, name: str) -> None:
            cache[name] = x.detach().clone()

        keepers = [(n, bind(keep, name=n)) for n in dict.fromkeys(names)]
        return self.logits_last(tokens, list(hooks) + keepers), cache

    def from_layer(
        self,
        layer: int,
        resid: Tensor,
        tokens: Tensor,
        hooks: Hooks,
        shared: SharedPrefix | None = None,
    ) -> Tensor:
        """Last-position logits of rows starting at ``layer`` from ``resid`` ``[rows, pos, d]``.

        ``tokens`` are the unpadded prompts of the group (any one row is enough for the bridge).
        ``shared``: the rows' shared prefix and the edits split at it (``hooks`` are the same
        edits on every position): a bridge runs it once per cell where that was checked to
        reproduce the plain run.
        """
        if shared is not None and not self.is_ssm:
            if self.model not in _INJECT_VERDICT or (
                self.tail_hooks and self.keep not in _TAIL_VERDICT.get(self.model, {})
            ):  # settle those on two rows, thrown away: these rows take the path later ones do
                self.from_layer(layer, resid[:2], tokens[:2], [])
            if _INJECT_VERDICT[self.model] is None:
                return self._shared(layer, resid, tokens, hooks, shared)
        if self.tail_hooks and self.keep not in _TAIL_VERDICT.get(self.model, {}):
            # The plain run first: it settles the bridge's residual-swap verdict without the
            # truncation, so a truncation failure is not blamed on the swap.
            tail = [*hooks, *self.tail_hooks]
            what = "truncating after the last mixer"
            with exact_matmul():  # a verdict TF32 rounding on one side must not decide
                slow = self._from_layer(layer, resid, tokens, hooks)
                fast, why = _attempt(lambda: self._from_layer(layer, resid, tokens, tail, what))
            why = why or _mismatch(fast, slow, 2e-6, what)
            _TAIL_VERDICT.setdefault(self.model, {})[self.keep] = why
            self.log.fell_back("tail", "every position", why)
            return slow
        return self._from_layer(layer, resid, tokens, list(hooks) + self._tail())

    def _shared(
        self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks, shared: SharedPrefix
    ) -> Tensor:
        """:meth:`from_layer` running the shared prefix once per cell, where checked (once per
        model, against the plain run). The checking call returns the path every later call takes,
        so no cell's numbers depend on which call (or which worker of a sharded sweep) checked."""
        model, plain = self.model, list(hooks) + self._tail()
        out = None
        if model not in _PREFIX_VERDICT:
            what = "running the shared prefix once per cell"
            with exact_matmul():
                slow = self._from_layer(layer, resid, tokens, plain)
                out, why = _attempt(lambda: self._prefixed(layer, resid, tokens, shared, what))
            _PREFIX_VERDICT[model] = why or _mismatch(out, slow, 1e-5, what)
            if _PREFIX_VERDICT[model] is not None:
                out = slow
        why = _PREFIX_VERDICT[model]
        if why is not None:
            self.log.fell_back("prefix", "every row", why)
            return out if out is not None else self._from_layer(layer, resid, tokens, plain)
        self.log.used("from_layer", "residual swap")
        self.log.used("prefix", f"once per cell ({shared.length} positions)")
        return out if out is not None else self._prefixed(layer, resid, tokens, shared)

    def _prefixed(
        self, layer: int, resid: Tensor, tokens: Tensor, shared: SharedPrefix, shortcut: str = ""
    ) -> Tensor:
        """The shared prefix on one row per cell (filling the KV cache, whose layers from
        ``layer`` on are then copied to each cell's rows), then the rest of every row on it."""
        P, k = shared.length, shared.cells
        G = len(resid) // k
        name = self.view[layer].resid_pre_hook
        cache = self._kv_cache()
        first, rest = resid[::G, :P], resid[:, P:]
        rows = torch.arange(k, device=resid.device).repeat_interleave(G)
        with shortcut_run(shortcut) if shortcut else nullcontext():
            with hooked(self.model, [(name, lambda x, hook: first), *shared.prefix_hooks]):
                self.model(tokens[:1, :P], past_key_values=cache, **self.keep_last)
            layers = getattr(cache, "layers", None)
            if layers is None or len(layers) != self.n_layers:
                raise ShortcutNotApplicable(f"the KV cache holds no per-layer entries: {layers!r}")
            for entry in layers[layer:]:
                if not all(isinstance(getattr(entry, a, None), Tensor) for a in ("keys", "values")):
                    raise ShortcutNotApplicable(
                        f"a KV cache layer without keys / values: {entry!r}"
                    )
                entry.keys, entry.values = entry.keys[rows], entry.values[rows]
            edits = [(name, lambda x, hook: rest), *shared.suffix_hooks, *self._tail()]
            with hooked(self.model, edits):
                out = self.model(tokens[:1, P:], past_key_values=cache, **self.keep_last)
        return self._pick(out)

    def _kv_cache(self) -> Any:
        """An empty Hugging Face ``DynamicCache`` for the bridge's model.

        Raises:
            ShortcutNotApplicable: transformers or the bridge offers none.
        """
        try:
            from transformers import DynamicCache
        except ImportError as err:
            raise ShortcutNotApplicable(f"transformers has no DynamicCache ({err})") from err
        hf_config = getattr(getattr(self.model, "original_model", None), "config", None)
        if hf_config is None:
            raise ShortcutNotApplicable(
                f"this {type(self.model).__name__} has no original_model.config to build a KV cache"
            )
        try:
            return DynamicCache(config=hf_config)
        except TypeError as err:  # an older transformers without DynamicCache(config=...)
            raise ShortcutNotApplicable(f"DynamicCache(config=...) failed: {err}") from err

    def _from_layer(
        self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks, shortcut: str = ""
    ) -> Tensor:
        """``shortcut``: this run tries a shortcut (its failures raise ShortcutNotApplicable)."""
        model = self.model
        if self.is_ssm:
            # The rows' token ids, for blocks that read the embeddings (Zamba2's shared blocks):
            # ``resid`` holds copies of the prompts ``tokens``, cell-major.
            ids = (
                tokens.repeat(len(resid) // len(tokens), 1)
                if len(resid) % len(tokens) == 0
                else None
            )
            with shortcut_run(shortcut) if shortcut else nullcontext(), hooked(model, hooks):
                final = model(resid, start_at_layer=layer, stop_at_layer=self.n_layers, tokens=ids)
            self.log.used("from_layer", "start_at_layer")
            return self._final(final)
        if model not in _INJECT_VERDICT:
            swap = "swapping the residual at hook_resid_pre"
            with exact_matmul():
                fast, why = _attempt(lambda: self._inject(layer, resid, tokens, hooks, swap))
                slow = self._bridge_start(layer, resid, hooks, shortcut)
            why = why or _mismatch(fast, slow, 1e-5, swap)
            _INJECT_VERDICT[model] = why
            self.log.fell_back("from_layer", "start_at_layer", why)
            return slow
        why = _INJECT_VERDICT[model]
        if why is None:
            out = self._inject(layer, resid, tokens, hooks, shortcut)
            self.log.used("from_layer", "residual swap")
            return out
        self.log.fell_back("from_layer", "start_at_layer", why)
        return self._bridge_start(layer, resid, hooks, shortcut)

    def _inject(
        self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks, shortcut: str = ""
    ) -> Tensor:
        def swap(x: Tensor, hook: Any) -> Tensor:
            return resid

        swap_hook = [(self.view[layer].resid_pre_hook, swap)]
        with (
            shortcut_run(shortcut) if shortcut else nullcontext(),
            hooked(self.model, swap_hook + list(hooks)),
        ):
            return self._pick(self.model(tokens[:1], **self.keep_last))

    def _bridge_start(self, layer: int, resid: Tensor, hooks: Hooks, shortcut: str = "") -> Tensor:
        with shortcut_run(shortcut) if shortcut else nullcontext(), hooked(self.model, hooks):
            out = self._pick(self.model(resid, start_at_layer=layer, **self.keep_last))
        self.log.used("from_layer", "start_at_layer")
        return out

    # ------------------------------------------------------------------ incremental
    def prefix(self, tokens: Tensor) -> tuple[Tensor, Any]:
        """Run the whole prompt once; returns (last logits, prefix state or ``None``).

        Only for runners that return the last position (``keep == 1``).

        The state holds what the last token needs from the earlier ones. ``None`` when the model
        offers no incremental path that reproduces its full forward (then edits of the last
        position are recomputed in full).
        """
        if self.keep != 1:
            raise InterventionError("internal: the incremental path returns the last position only")
        if self.is_ssm:
            logits, state = self.model.prefix_state(tokens)
            path = "SSM state step"
        else:
            try:
                logits, state = self._bridge_prefix(tokens)
            except ShortcutNotApplicable as err:
                self.log.fell_back("incremental", "full recomputation", str(err))
                return self.logits_last(tokens), None
            path = "KV-cache step"
        if state is None:
            self.log.fell_back("incremental", "full recomputation", "no prefix state")
            return logits, None
        check = self.step(state, 1, ())
        if not _close(check, logits):
            diff = float((check - logits).abs().max())
            warnings.warn(
                f"gna_lens: the incremental last-token path of this {self.view.model_type} "
                f"does not reproduce its full forward (max abs diff {diff:.2e}); recomputing "
                "whole prompts instead.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.log.fell_back(
                "incremental",
                "full recomputation",
                f"the {path} does not reproduce the full forward (max abs diff {diff:.2e})",
            )
            return logits, None
        self.log.used("incremental", path)
        return logits, state

    def step(self, state: Any, K: int, hooks: Hooks) -> Tensor:
        """Last-token logits ``[K * G, d_vocab]`` of ``K`` packed copies (cell-major)."""
        if self.is_ssm:
            with hooked(self.model, hooks):
                return cast("Tensor", self.model.step(state, K))
        return self._bridge_step(state, K, hooks)

    def _bridge_prefix(self, tokens: Tensor) -> tuple[Tensor, Any]:
        """The prompt's logits and its KV cache minus the last token.

        Raises:
            ShortcutNotApplicable: The bridge offers no usable Hugging Face KV cache.
        """
        model = self.model
        cache = self._kv_cache()
        with shortcut_run("the forward with past_key_values"):
            try:
                out = model(tokens, past_key_values=cache, **self.keep_last)
            except TypeError as err:
                if "past_key_values" not in str(err):
                    raise
                # A forward that takes no past_key_values.
                raise ShortcutNotApplicable(f"the forward takes no past_key_values: {err}") from err
        if cache.get_seq_length() != tokens.shape[1]:
            raise ShortcutNotApplicable(
                f"the KV cache recorded {cache.get_seq_length()} positions of a "
                f"{tokens.shape[1]}-token prompt"
            )
        cache.crop(-1)
        state = {
            "cache": cache,
            "last": tokens[:, -1:],
            "G": tokens.shape[0],
            "length": tokens.shape[1] - 1,
            "expanded": {},
        }
        return out[:, -1], state

    def _bridge_step(self, state: dict[str, Any], K: int, hooks: Hooks) -> Tensor:
        G, length = state["G"], state["length"]
        cache = state["expanded"].get(K)
        if cache is None:
            cache = copy.deepcopy(state["cache"])
            if K > 1:
                cache.batch_select_indices(torch.arange(G, device=state["last"].device).repeat(K))
            state["expanded"] = {K: cache}  # one packing at a time (as the SSM prefix keeps)
        try:
            with hooked(self.model, hooks):
                out = self.model(
                    state["last"].repeat(K, 1), past_key_values=cache, **self.keep_last
                )
        finally:
            extra = cache.get_seq_length() - length
            if extra > 0:
                cache.crop(-extra)
        return cast("Tensor", out[:, -1])


def _attempt(fn: Callable[[], Tensor]) -> tuple[Tensor | None, str | None]:
    """``(fn(), None)``, or ``(None, reason)`` on :class:`ShortcutNotApplicable` (only)."""
    try:
        return fn(), None
    except ShortcutNotApplicable as err:
        return None, str(err)
