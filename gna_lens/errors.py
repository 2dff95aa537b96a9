"""Exceptions raised by gna_lens.

Every error raised on bad input derives from :class:`GnaLensError`, so callers can catch the
package's errors in one place. Messages repeat what was passed, say what was expected and how to
fix it.
"""


class GnaLensError(Exception):
    """Base class of every error raised by gna_lens."""


class ConfigError(GnaLensError, ValueError):
    """A model configuration or architecture that gna_lens cannot serve."""


class HookError(GnaLensError, ValueError):
    """A hook name that does not exist, or a hook that returned something unusable."""


class PatternEditError(GnaLensError, ValueError):
    """An edit that cannot take effect exactly: of a materialized attention pattern (wrong shape,
    low precision, a layer whose edits are discarded or cannot be shown to take effect, a mask
    outside the materialized selection), or of SSM states while ``hook_pattern`` is hooked."""


class TaskError(GnaLensError, ValueError):
    """A task that cannot be built from the given inputs (tokenizer, records, sizes)."""


class InterventionError(GnaLensError, ValueError):
    """An intervention (ablation, mask, patch, attribution) asked for with unusable inputs."""


class WorkerError(GnaLensError, RuntimeError):
    """A sweep sharded over workers (:class:`gna_lens.distributed.RayExecutor`) could not
    finish: its workers failed more often than allowed, could not load the model, or raised an
    unexpected error. The message names the cells left and the worker's error."""


class DistillationDiverged(GnaLensError, RuntimeError):
    """A training stage (:func:`gna_lens.hybrid.distill`) whose loss rose far above where it
    started, or stopped being finite: the run stops instead of finishing on broken weights. The
    message names the stage, the step, the starting and the current loss, and the fix (a lower
    learning rate; float32 instead of bfloat16 autocast to check)."""


class GnaLensWarning(UserWarning):
    """A result that is not what was asked for, and why (e.g. ``top(k)`` returning fewer heads)."""
