"""The run-time shape checker of the test suite (``pyproject.toml``'s ``--jaxtyping-packages``).

jaxtyping's import hook wraps every function of gna_lens in ``jaxtyped(typechecker=checker)``;
:func:`checker` then checks, on every call during the tests, the arguments and the return value
annotated with a jaxtyping array type (``Float[Tensor, "batch pos"]``, possibly ``| None``):
dtype, rank and named dimensions, which must agree across one call's arguments and its return
value, once the function has returned. A call whose arguments break their annotation runs
anyway: if the function refuses it with its own error (which names the fix: what a test of bad
input expects), that error stands; if the function accepts it, the annotation is wrong and the
call fails. Other annotations are
left to mypy: a full run-time checker (beartype) would refuse bad input (``mode="middle"`` for a
``Literal``) before the library's own error is raised.
"""

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

import jaxtyping


class ShapeError(TypeError):
    """A jaxtyping annotation of gna_lens does not hold on a real call."""


def _array_types(annotation: Any) -> tuple[type, ...] | None:
    """The jaxtyping array types an annotation allows (``X``, ``X | None``); ``None`` if it is
    not a jaxtyping annotation."""
    if isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray):
        return (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        arrays = tuple(
            a for a in args if isinstance(a, type) and issubclass(a, jaxtyping.AbstractArray)
        )
        if arrays and all(a in arrays or a is type(None) for a in args):
            return arrays + ((type(None),) if type(None) in args else ())
    return None


def _check(value: Any, allowed: tuple[type, ...], what: str, fn: Callable[..., Any]) -> None:
    if not isinstance(value, allowed):
        raise _violation(value, allowed, what, fn)


def _violation(
    value: Any, allowed: tuple[type, ...], what: str, fn: Callable[..., Any]
) -> "ShapeError":
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    names = " | ".join(getattr(a, "__name__", str(a)) for a in allowed)
    return ShapeError(
        f"{fn.__module__}.{fn.__qualname__}: {what} is {type(value).__name__} of shape "
        f"{tuple(shape) if shape is not None else '-'} and dtype {dtype}; annotated "
        f"{names} (a named dimension must have one size across the call's arguments and "
        "return value)."
    )


def checker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The typechecker jaxtyping applies to the two stand-ins it makes of each function: one
    with the parameters only, called before the function runs, and one with the parameters, the
    return annotation and one more keyword-only argument (``ret...``) holding the return value,
    called after it returned. The first checks nothing, so that input the function refuses with
    its own error reaches that error; the second checks the arguments and the return value
    (named dimensions shared), so an annotation that a call the function *accepted* breaks
    fails the test."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except Exception:  # forward references that do not resolve: nothing to check
        return fn
    ps = list(sig.parameters.values())
    out = ps[-1] if ps else None
    if (
        out is None
        or out.kind is not inspect.Parameter.KEYWORD_ONLY
        or not out.name.startswith("ret")
    ):
        return fn  # the parameters-only stand-in
    params = {
        n: t for n, a in hints.items() if n not in ("return", out.name) and (t := _array_types(a))
    }
    ret = _array_types(hints["return"]) if "return" in hints else None
    if not params and ret is None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        for name, allowed in params.items():
            if name in bound.arguments:
                _check(bound.arguments[name], allowed, f"argument {name!r}", fn)
        if ret is not None:
            _check(bound.arguments[out.name], ret, "the return value", fn)
        return fn(*args, **kwargs)

    return wrapper
