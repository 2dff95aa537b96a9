"""Writing a results table as ``table.md`` / ``.csv`` / ``.json`` / ``.svg`` (the tables of
``gna-lens evaluate`` and ``gna-lens hybrid``)."""

import json
from pathlib import Path
from typing import Any


def write_table_files(table: Any, folder: str | Path, stem: str = "table") -> dict[str, Path]:
    """Write ``table``'s ``to_markdown()``, ``to_dataframe()`` (CSV), ``to_dict()`` (JSON) and,
    where it has one, ``to_svg()`` into ``folder`` as ``{stem}.md``, ``.csv``, ``.json``,
    ``.svg``.

    Returns:
        ``{"markdown": ..., "csv": ..., "json": ...}`` and ``"svg"`` when written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": folder / f"{stem}.md",
        "csv": folder / f"{stem}.csv",
        "json": folder / f"{stem}.json",
    }
    paths["markdown"].write_text(table.to_markdown(), encoding="utf-8")
    table.to_dataframe().to_csv(paths["csv"], index=False)
    text = json.dumps(table.to_dict(), indent=1) + "\n"
    paths["json"].write_text(text, encoding="utf-8")
    if hasattr(table, "to_svg"):
        paths["svg"] = folder / f"{stem}.svg"
        paths["svg"].write_text(table.to_svg(), encoding="utf-8")
    return paths
