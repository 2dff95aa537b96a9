"""Forward passes that reuse what an intervention cannot change.

Two kinds of reuse, for both model kinds (TransformerBridge, HookedSSM):

- :meth:`Runner.from_layer`: an edit at layer ``l`` leaves the residual stream below ``l``
  unchanged, so runs start from the cached ``hook_resid_pre`` of layer ``l``. HookedSSM skips the
  lower blocks with ``start_at_layer``. TransformerBridge 4.3's ``start_at_layer`` still executes
  blocks ``0..l-1`` (it discards their output), so instead the bridge runs *one* row of tokens and
  a hook on ``blocks.{l}.hook_resid_pre`` swaps in the cached residual of every packed row: the
  lower blocks run on one row instead of all of them. The swap is checked once per model against
  ``start_at_layer`` and dropped if it does not match.
- :meth:`Runner.prefix` / :meth:`Runner.step`: an edit at the final position only leaves every
  earlier position unchanged, so the prompt minus its last token runs once; each edit then
  recomputes only the last token: from the Hugging Face KV cache (bridge) or from the SSM states,
  convolution windows and attention keys/values of the prefix (HookedSSM, see
  :mod:`gna_lens.interventions._ssm_step`). The step is checked against the full forward on
  every group; on a mismatch the caller falls back to full recomputation.

Only the logits at the last position are computed where the model allows it (HookedSSM: final
norm and unembedding on one position; bridge: ``logits_to_keep=1``).
"""

import copy
import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gna_lens.errors import InterventionError
from gna_lens.heads import HeadView, _is_hooked_ssm
from gna_lens.interventions._common import hooked

Hooks = Sequence[tuple[Any, Callable[..., Any]]]

# Per bridge model: does swapping the residual at blocks.{l}.hook_resid_pre match start_at_layer?
_INJECT_OK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
# Per model: does keeping only the last position after the last block's mixer match?
# (per number of kept positions: a bridge whose residual add broadcasts passes for 1, not for more)
_TAIL_OK: "weakref.WeakKeyDictionary[Any, dict[int, bool]]" = weakref.WeakKeyDictionary()
STEP_RTOL = 1e-4


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

    def __init__(self, model: Any, view: HeadView, keep: int = 1):
        self.model = model
        self.view = view
        self.n_layers = view.n_layers
        self.is_ssm = _is_hooked_ssm(model)
        #: How many trailing positions' logits every method returns: 1 gives ``[rows, d_vocab]``
        #: (the query position), ``keep > 1`` gives ``[rows, keep, d_vocab]`` (metrics over several
        #: positions, e.g. the next-token loss of a control text).
        self.keep = keep
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
        return self.tail_hooks if _TAIL_OK.get(self.model, {}).get(self.keep) else []

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

    def clean(self, tokens: Tensor, names: Sequence[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """A clean run keeping the activations ``names``; returns (last logits, activations)."""
        cache: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any, name: str) -> None:
            cache[name] = x.detach().clone()

        hooks = [(n, _bind_name(keep, n)) for n in dict.fromkeys(names)]
        return self.logits_last(tokens, hooks), cache

    def from_layer(self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks) -> Tensor:
        """Last-position logits of rows starting at ``layer`` from ``resid`` ``[rows, pos, d]``.

        ``tokens`` are the unpadded prompts of the group (any one row is enough for the bridge).
        """
        if self.tail_hooks and self.keep not in _TAIL_OK.get(self.model, {}):
            fast = _attempt(
                lambda: self._from_layer(layer, resid, tokens, [*hooks, *self.tail_hooks])
            )
            slow = self._from_layer(layer, resid, tokens, hooks)
            ok = fast is not None and fast.shape == slow.shape and _close(fast, slow, 2e-6)
            _TAIL_OK.setdefault(self.model, {})[self.keep] = ok
            return slow
        return self._from_layer(layer, resid, tokens, list(hooks) + self._tail())

    def _from_layer(self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks) -> Tensor:
        model = self.model
        if self.is_ssm:
            with hooked(model, hooks):
                final = model(resid, start_at_layer=layer, stop_at_layer=self.n_layers)
            return self._final(final)
        ok = _INJECT_OK.get(model)
        if ok is None:
            fast = _attempt(lambda: self._inject(layer, resid, tokens, hooks))
            slow = self._bridge_start(layer, resid, hooks)
            _INJECT_OK[model] = fast is not None and _close(fast, slow, 1e-5)
            return slow
        if ok:
            return self._inject(layer, resid, tokens, hooks)
        return self._bridge_start(layer, resid, hooks)

    def _inject(self, layer: int, resid: Tensor, tokens: Tensor, hooks: Hooks) -> Tensor:
        def swap(x: Tensor, hook: Any) -> Tensor:
            return resid

        swap_hook = [(self.view[layer].resid_pre_hook, swap)]
        with hooked(self.model, swap_hook + list(hooks)):
            return self._pick(self.model(tokens[:1], **self.keep_last))

    def _bridge_start(self, layer: int, resid: Tensor, hooks: Hooks) -> Tensor:
        with hooked(self.model, hooks):
            return self._pick(self.model(resid, start_at_layer=layer, **self.keep_last))

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
            from gna_lens.interventions._ssm_step import ssm_prefix

            logits, state = ssm_prefix(self.model, tokens)
        else:
            logits, state = self._bridge_prefix(tokens)
        if state is not None:
            check = self.step(state, 1, ())
            if not _close(check, logits):
                warnings.warn(
                    f"gna_lens: the incremental last-token path of this {self.view.model_type} "
                    "does not reproduce its full forward (max abs diff "
                    f"{float((check - logits).abs().max()):.2e}); recomputing whole prompts "
                    "instead.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                state = None
        return logits, state

    def step(self, state: Any, K: int, hooks: Hooks) -> Tensor:
        """Last-token logits ``[K * G, d_vocab]`` of ``K`` packed copies (cell-major)."""
        if self.is_ssm:
            from gna_lens.interventions._ssm_step import ssm_step

            with hooked(self.model, hooks):
                return ssm_step(self.model, state, K)
        return self._bridge_step(state, K, hooks)

    def _bridge_prefix(self, tokens: Tensor) -> tuple[Tensor, Any]:
        model = self.model
        try:
            from transformers import DynamicCache

            hf_config = model.original_model.config
            cache = DynamicCache(config=hf_config)
            out = model(tokens, past_key_values=cache, **self.keep_last)
            if cache.get_seq_length() != tokens.shape[1]:
                raise ValueError("the cache did not record the prompt")
            cache.crop(-1)
        except Exception:  # no usable KV cache: full recomputation instead
            return self.logits_last(tokens), None
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
                cache.batch_select_indices(torch.arange(G).repeat(K).to(state["last"].device))
            state["expanded"][K] = cache
        try:
            with hooked(self.model, hooks):
                out = self.model(
                    state["last"].repeat(K, 1), past_key_values=cache, **self.keep_last
                )
        finally:
            extra = cache.get_seq_length() - length
            if extra > 0:
                cache.crop(-extra)
        return out[:, -1]


def _attempt(fn: Callable[[], Tensor]) -> Tensor | None:
    """Run a shortcut that the model may not support; ``None`` if it raises."""
    try:
        return fn()
    except Exception:  # any failure of a shortcut means: use the plain path
        return None


def _bind_name(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def bound(x: Tensor, hook: Any) -> Any:
        return fn(x, hook, name=name)

    return bound
