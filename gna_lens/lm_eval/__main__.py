"""``python -m gna_lens.lm_eval`` (also ``gna-lens lm-eval``): lm-eval's own command line with the
``gna_lens`` model registered and the offline tasks written on demand.

lm-eval 0.4 discovers models only in its own package, so ``lm_eval --model gna_lens`` cannot find
this backend; this wrapper registers it and hands every argument to lm-eval::

    python -m gna_lens.lm_eval --model gna_lens \\
        --model_args pretrained=smollm2-135m,remove=L16H0;L18H6,mode=zero \\
        --tasks gna_kv,gna_mmlu_letter --limit 100 --batch_size 8

When ``--tasks`` names offline tasks (``gna_kv``, ``gna_mmlu_letter``, ...) and no
``--include_path`` is given, they are written for the model's tokenizer under
``~/.cache/gna_lens/lm_eval_tasks/`` and that folder is passed as ``--include_path``.
"""

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "task_cache_dir"]


def task_cache_dir() -> Path:
    """Where the wrapper writes offline tasks (``$GNA_LENS_CACHE`` or ``~/.cache/gna_lens``)."""
    root = os.environ.get("GNA_LENS_CACHE") or Path.home() / ".cache" / "gna_lens"
    return Path(root) / "lm_eval_tasks"


def _value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _with_local_tasks(argv: list[str]) -> list[str]:
    from gna_lens.lm_eval.tasks import is_local, write_tasks

    tasks = [t.strip() for t in (_value(argv, "--tasks") or "").split(",") if t.strip()]
    local = [t for t in tasks if is_local(t)]
    if not local or _value(argv, "--include_path") is not None:
        return argv
    model_args = _value(argv, "--model_args") or ""
    m = re.search(r"(?:^|,)pretrained=([^,]+)", model_args)
    if m is None:
        raise SystemExit(
            f"gna_lens.lm_eval: --tasks {','.join(local)} are written for the model's tokenizer, "
            "but --model_args has no pretrained=...; pass it, or --include_path with tasks "
            "written by gna_lens.lm_eval.write_tasks."
        )
    from transformers import AutoTokenizer

    from gna_lens.models.loading import resolve_name

    name = m.group(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_name(name))
    limit_arg = _value(argv, "--limit")
    limit = int(float(limit_arg)) if limit_arg and float(limit_arg) >= 1 else 100
    folder = task_cache_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{limit}"
    write_tasks(folder, tokenizer, local, limit=limit)
    print(f"gna_lens.lm_eval: offline tasks {local} written to {folder}", file=sys.stderr)
    return [*argv, "--include_path", str(folder)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line with ``argv`` (default ``sys.argv[1:]``)."""
    import gna_lens.lm_eval  # noqa: F401  (registers the gna_lens model)

    args = _with_local_tasks(list(sys.argv[1:] if argv is None else argv))
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
