"""Hook contexts of the interventions: :func:`hooked` adds forward hooks for one ``with`` block
and removes them on any exit (exceptions included); :func:`count_hooks` checks none is left."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from gna_lens.errors import HookError
from gna_lens.heads import HookedModel

__all__ = ["EMBED_HOOK", "bind", "count_hooks", "hooked"]


#: The hook whose output is the token embeddings ``[batch, pos, d_model]`` (HookedSSM and
#: TransformerBridge): equal rows there are equal tokens.
EMBED_HOOK = "hook_embed"


def bind(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    """``fn(x, hook, **kw)`` as a hook function of ``(x, hook)``."""

    def bound(x: Tensor, hook: Any) -> Any:
        return fn(x, hook, **kw)

    return bound


@contextmanager
def hooked(
    model: HookedModel, fwd_hooks: Sequence[tuple[Any, Callable[..., Any]]]
) -> Iterator[Any]:
    """``model.hooks(fwd_hooks)`` that also fails loudly if a hook survived the context.

    An exception raised inside the block propagates unchanged (a leak found then is added to it
    as a note, never raised in its place); after a clean exit a leak raises
    :class:`~gna_lens.errors.HookError`.
    """
    before = count_hooks(model)
    try:
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            yield model
    except BaseException as err:
        after = count_hooks(model)
        if after != before:
            err.add_note(f"gna_lens: hooks leaked as well: {before} before, {after} after.")
        raise
    after = count_hooks(model)
    if after != before:
        raise HookError(
            f"hooks leaked: the model had {before} hooks before this intervention and {after} "
            "after it. Fix: model.reset_hooks(including_permanent=False), and report this."
        )


def count_hooks(model: HookedModel) -> int:
    """Total forward and backward hooks on the model's hook points."""
    total = 0
    seen: set[int] = set()
    for hp in getattr(model, "hook_dict", {}).values():
        if id(hp) in seen:
            continue
        seen.add(id(hp))
        total += len(getattr(hp, "fwd_hooks", [])) + len(getattr(hp, "bwd_hooks", []))
        total += len(getattr(hp, "_forward_hooks", {})) + len(getattr(hp, "_backward_hooks", {}))
    return total
