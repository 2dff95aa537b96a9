"""The paper's comparison of architectures (:func:`compare_models`): the same benchmark table
for several models (Llama-3.2-3B and the SSM distilled from it, Llamba-3B), and what each keeps
per sequence while generating: the recurrent states an SSM keeps (fixed) against the KV cache a
Transformer grows with the sequence (:func:`~gna_lens.models.state.state_bytes`).
"""

import gc
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from gna_lens.device import resolve_dtype
from gna_lens.errors import ConfigError
from gna_lens.lm_eval.table import DEFAULT_TASKS, BenchmarkTable, evaluate_table
from gna_lens.models.state import StateBytes, state_bytes
from gna_lens.table import Table

__all__ = ["DEFAULT_STATE_LENGTHS", "ModelComparison", "compare_models"]

#: Sequence lengths of the state-size table (tokens).
DEFAULT_STATE_LENGTHS = (2048, 8192, 32768)


@dataclass(frozen=True)
class ModelComparison(Table):
    """Benchmark tables of several models with the same tasks and rows, and their state sizes.

    Attributes:
        tables: One :class:`~gna_lens.lm_eval.BenchmarkTable` per model, in the order given.
        states: One :class:`~gna_lens.models.state.StateBytes` per model (same order).
        method: What was compared and how (the settings shared by every table, the state
            dtype and lengths).
    """

    _stem: ClassVar[str] = "comparison"

    tables: tuple[BenchmarkTable, ...]
    states: tuple[StateBytes, ...]
    method: dict[str, Any] = field(default_factory=dict)

    @property
    def models(self) -> list[str]:
        """The models' names, in order."""
        return [t.model for t in self.tables]

    def to_dataframe(self) -> Any:
        """Every table's rows (:meth:`BenchmarkTable.to_dataframe`) with a leading ``model``
        column."""
        import pandas as pd

        frames = []
        for table in self.tables:
            df = table.to_dataframe()
            df.insert(0, "model", table.model)
            frames.append(df)
        return pd.concat(frames, ignore_index=True)

    def state_dataframe(self) -> Any:
        """One row per model and length: heads, recurrent-state, KV-cache and total bytes."""
        import pandas as pd

        return pd.concat([s.to_dataframe() for s in self.states], ignore_index=True)

    def to_markdown(self) -> str:
        """Per task, the rows (heads removed) against the models; then the state sizes."""
        from gna_lens.render.markdown import comparison_markdown

        return comparison_markdown(self)

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (each table's :meth:`BenchmarkTable.to_dict`)."""
        return {
            "models": self.models,
            "tables": [t.to_dict() for t in self.tables],
            "states": self.state_dataframe().to_dict(orient="records"),
            "method": self.method,
        }

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write ``comparison.md``, ``comparison.csv``, ``state.csv`` and ``comparison.json``
        into ``folder`` (each model's own table files are in its subfolder, written by
        :func:`compare_models`).

        Returns:
            ``{"markdown": ..., "csv": ..., "state": ..., "json": ...}``.
        """
        paths = super().write(folder)
        paths["state"] = Path(folder) / "state.csv"
        self.state_dataframe().to_csv(paths["state"], index=False)
        return paths


def _slug(name: str) -> str:
    """A folder name for a model name (``cartesia-ai/Llamba-3B`` -> ``cartesia-ai_Llamba-3B``;
    a local folder -> its last part), at most 80 characters."""
    try:
        local = len(name) < 4096 and Path(name).is_dir()
    except OSError:
        local = False
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name).name if local else name)[:80]


def compare_models(
    models: Sequence[Any],
    tasks: Sequence[str] = DEFAULT_TASKS,
    remove_top: Sequence[int] = (0, 10, 20, 30),
    rankings: Sequence[Any] | None = None,
    *,
    state_lengths: Sequence[int] = DEFAULT_STATE_LENGTHS,
    state_dtype: Any = "bfloat16",
    dtype: Any = "float32",
    device: str | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **table_kwargs: Any,
) -> ModelComparison:
    """The paper's comparison: :func:`~gna_lens.lm_eval.evaluate_table` on each model with the
    same tasks and rows, and each model's state size.

    Models given by name are loaded one at a time (:func:`gna_lens.load_model`) and released
    before the next, so two 3B models need the memory of one.

    Args:
        models: Two or more models: loaded ones, or what :func:`gna_lens.load_model` loads
            (``"meta-llama/Llama-3.2-3B"``, ``"cartesia-ai/Llamba-3B"``, a folder, a zoo name).
        tasks: lm-eval tasks, as :func:`~gna_lens.lm_eval.evaluate_table`.
        remove_top: Rows: numbers of each model's own top heads removed.
        rankings: One ranking per model (``None`` entries, or ``None``: each model ranks its
            own heads, :func:`~gna_lens.lm_eval.evaluate_table`'s ``ranking=None``).
        state_lengths: Sequence lengths of the state-size table.
        state_dtype: The dtype the states are counted in (default ``"bfloat16"``, 2 bytes, as
            the models are served), whatever the dtype the benchmarks run in.
        dtype: Weights dtype of models loaded here.
        device: Device of models loaded here (``None``: :func:`gna_lens.load_model`'s default).
        out: Folder: ``comparison.md`` / ``.csv`` / ``.json``, ``state.csv``, and one subfolder
            per model with its table files (``None``: nothing written).
        progress: Print progress.
        **table_kwargs: Passed to every :func:`~gna_lens.lm_eval.evaluate_table` call
            (``mode``, ``positions``, ``limit``, ``ranking_metric``, ``random_draws``, ...).

    Returns:
        A :class:`ModelComparison`.

    Raises:
        ConfigError: For fewer than two models, or rankings of another length.

    Examples:
        >>> import tempfile
        >>> from gna_lens.testing import TOY_AGGREGATE_HEAD, toy_gna_model, toy_gna_task
        >>> from gna_lens.lm_eval import write_task
        >>> tasks = tempfile.mkdtemp()
        >>> a, b = toy_gna_model(), toy_gna_model(generic_head=True)
        >>> _ = write_task(toy_gna_task(a, n_pairs=4, n_samples=8, seed=1), tasks, "toy_kv")
        >>> cmp = compare_models(
        ...     [a, b], ["toy_kv"], [0, 1], [[TOY_AGGREGATE_HEAD]] * 2, task_dir=tasks, progress=False
        ... )
        >>> [t.cell(1, "toy_kv").value.value < t.cell(0, "toy_kv").value.value for t in cmp.tables]
        [True, True]
    """
    models = list(models)
    if len(models) < 2:
        raise ConfigError(
            f"compare_models got {len(models)} model(s); expected two or more (e.g. "
            "['meta-llama/Llama-3.2-3B', 'cartesia-ai/Llamba-3B']). For one model use "
            "evaluate_table."
        )
    rankings = [None] * len(models) if rankings is None else list(rankings)
    if len(rankings) != len(models):
        raise ConfigError(
            f"compare_models: {len(rankings)} rankings for {len(models)} models; expected one "
            "per model (None where the model ranks its own heads)."
        )
    lengths = tuple(int(L) for L in state_lengths)
    counted = resolve_dtype(state_dtype)
    if counted is None:
        raise ConfigError(f"compare_models(state_dtype={state_dtype!r}); expected a dtype.")
    tables: list[BenchmarkTable] = []
    states: list[StateBytes] = []
    used: set[str] = set()
    for given, ranking in zip(models, rankings, strict=True):
        model = given
        if isinstance(given, (str, Path)):
            from gna_lens.models import load_model

            if progress:
                print(f"compare_models: loading {given}", flush=True)
            model = load_model(
                str(given), dtype=resolve_dtype(dtype) or torch.float32, device=device or "auto"
            )
        name = str(getattr(getattr(model, "cfg", None), "model_name", "") or type(model).__name__)
        sub = _slug(str(given) if isinstance(given, (str, Path)) else name) or "model"
        while sub in used:
            sub += "_"
        used.add(sub)
        table = evaluate_table(
            model, tasks, remove_top, ranking, dtype=dtype, device=device,
            out=None if out is None else Path(out) / sub, progress=progress, **table_kwargs,
        )  # fmt: skip
        tables.append(table)
        states.append(state_bytes(model, lengths, dtype=counted))
        if isinstance(given, (str, Path)):
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    method = {
        "tasks": list(tasks),
        "remove_top": [int(k) for k in remove_top],
        "rankings": ["given" if r is not None else "computed per model" for r in rankings],
        "state_dtype": str(counted).removeprefix("torch."),
        "state_lengths": list(lengths),
        "subfolders": sorted(used),
    }
    result = ModelComparison(tuple(tables), tuple(states), method)
    if out is not None:
        result.write(out)
    return result
