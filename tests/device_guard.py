"""Guards for gna_lens's device rule, usable without a GPU (CI has none).

The rule (``gna_lens/device.py``): every tensor gna_lens makes says where it goes. A tensor made
without ``device=`` lands on the CPU (or on whatever default device the user set), and the first
operation that mixes it with a CUDA model's values fails, on a GPU only, where CI never looks.

- :func:`violations` reads the source (static: every code path, run or not): tensor factories
  without ``device=`` (module parameters and buffers excepted: they move with their module),
  ``torch.from_numpy`` and ``torch.Tensor(...)`` (always the CPU), ``.cuda()``, and, outside
  ``gna_lens/device.py``, ``.cpu()``, ``.to("cpu")`` / ``.to("cuda")``, a literal
  ``device="cpu"`` (as ``.to(device="cpu")`` or in a factory) and ``torch.device("cpu")``.
- :class:`FactoryGuard` watches a run (dynamic: what actually executes, through every caller):
  a tensor factory called from gna_lens code without ``device=`` raises at the call.
"""

import ast
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1] / "gna_lens"

#: torch functions that make a new tensor and take ``device=``.
FACTORIES = frozenset(
    {
        "arange", "as_tensor", "empty", "eye", "full", "linspace", "logspace", "ones", "rand",
        "randint", "randn", "randperm", "range", "tensor", "zeros", "tril_indices",
        "triu_indices",
    }
)  # fmt: skip

#: The one module allowed to move values to the host.
POLICY_MODULE = ROOT / "device.py"


def _is_module_state(parents: list[ast.AST]) -> bool:
    """The factory's value becomes an ``nn.Parameter`` or a registered buffer (moves with
    ``module.to``)."""
    for node in reversed(parents[-3:]):
        if isinstance(node, ast.Call):
            name = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if name in ("Parameter", "register_buffer"):
                return True
    return False


def _host_literal(node: ast.AST) -> bool:
    """A string naming a device outright (``"cpu"``, ``"cuda"``, ``"cuda:0"``)."""
    return isinstance(node, ast.Constant) and str(node.value).split(":")[0] in ("cpu", "cuda")


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every breach of the device rule in ``source``, as ``"file:line: what"``."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    policy = Path(filename).resolve() == POLICY_MODULE

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            kw = {k.arg for k in node.keywords}
            where = f"{filename}:{node.lineno}"
            is_torch = isinstance(f.value, ast.Name) and f.value.id == "torch"
            literal = [k for k in node.keywords if k.arg == "device" and _host_literal(k.value)]
            if literal and not policy:
                found.append(
                    f"{where}: device={ast.unparse(literal[0].value)} (use HOST or the policy)"
                )
            elif is_torch and f.attr == "device" and node.args and _host_literal(node.args[0]):
                if not policy:
                    found.append(f"{where}: torch.device({ast.unparse(node.args[0])}) (use HOST)")
            elif is_torch and f.attr in ("from_numpy", "Tensor"):
                found.append(
                    f"{where}: torch.{f.attr}(...) (lands on the CPU; torch.tensor(..., device=))"
                )
            elif is_torch and f.attr in FACTORIES and "device" not in kw:
                if not _is_module_state(parents):
                    found.append(f"{where}: torch.{f.attr}(...) without device=")
            elif f.attr == "cuda" and not is_torch:
                found.append(f"{where}: .cuda() (use DevicePolicy.put)")
            elif f.attr == "cpu" and not is_torch and not policy:
                found.append(f"{where}: .cpu() (use gna_lens.device.to_host)")
            elif (
                f.attr == "to"
                and not policy
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).split(":")[0] in ("cpu", "cuda")
            ):
                found.append(f"{where}: .to({node.args[0].value!r}) (use the DevicePolicy)")
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node])

    visit(tree, [])
    return found


def library_violations() -> list[str]:
    """:func:`violations` over every module of gna_lens."""
    out: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        out += violations(path.read_text(), str(path))
    return out


class DeviceRuleError(AssertionError):
    """A gna_lens function made a tensor without saying where it goes."""


class FactoryGuard:
    """Raise when code under gna_lens/ calls a tensor factory without ``device=``.

    Inside the block, each ``torch.<factory>`` of :data:`FACTORIES` is replaced by a wrapper that
    judges its caller (only the factories: a ``TorchFunctionMode`` would see every operation and
    made the suite half again slower). Calls made by torch, transformers or TransformerLens are
    not judged (their devices are their business); only the frame that called torch matters. A
    module's ``__init__`` may make its parameters and buffers without a device (they move with
    ``module.to``), as the static rule allows for ``nn.Parameter`` / ``register_buffer``.
    """

    def __init__(self) -> None:
        self.checked = 0
        self._saved: dict[str, Any] = {}

    def _judge(self, name: str, kwargs: dict[str, Any]) -> None:
        caller = sys._getframe(2)
        path = Path(caller.f_code.co_filename).resolve()
        if ROOT not in path.parents or path == POLICY_MODULE:
            return
        self.checked += 1  # a gna_lens factory call, judged
        building = caller.f_code.co_name == "__init__" and isinstance(
            caller.f_locals.get("self"), torch.nn.Module
        )  # a module's own state, which moves with module.to()
        if "device" not in kwargs and not building:
            raise DeviceRuleError(
                f"{path.relative_to(ROOT.parent)}:{caller.f_lineno}: "
                f"torch.{name}(...) without device=; say where the tensor goes "
                "(DevicePolicy.put / device=policy.device for model inputs, host_full / "
                "device=HOST for results)."
            )

    def _wrap(self, name: str, real: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._judge(name, kwargs)
            return real(*args, **kwargs)

        return guarded

    def __enter__(self) -> "FactoryGuard":
        # torch caches its set of factories (functools.cache) the first time a `with
        # torch.device(...)` block asks: filled now, it holds the real ones, not the wrappers
        # (which it would keep for the process: transformers' model set-up then left a
        # TransformerBridge's padded-batch logits different, in every later test).
        from torch.utils._device import _device_constructors

        _device_constructors()
        for name in FACTORIES:
            self._saved[name] = getattr(torch, name)
            setattr(torch, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._saved.items():
            setattr(torch, name, real)
        self._saved.clear()
