"""Writing a results table as ``table.md`` / ``.csv`` / ``.json`` / ``.svg`` (the tables of
``gna-lens evaluate`` and ``gna-lens hybrid``)."""

import json
from pathlib import Path
from typing import Any


def write_table_files(table: Any, folder: str | Path) -> dict[str, Path]:
    """Write ``table``'s ``to_markdown()``, ``to_dataframe()`` (CSV), ``to_dict()`` (JSON) and
    ``to_svg()`` into ``folder`` as ``table.md``, ``table.csv``, ``table.json``, ``table.svg``.

    Returns:
        ``{"markdown": ..., "csv": ..., "json": ..., "svg": ...}``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": folder / "table.md",
        "csv": folder / "table.csv",
        "json": folder / "table.json",
        "svg": folder / "table.svg",
    }
    paths["markdown"].write_text(table.to_markdown(), encoding="utf-8")
    table.to_dataframe().to_csv(paths["csv"], index=False)
    paths["json"].write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
    paths["svg"].write_text(table.to_svg(), encoding="utf-8")
    return paths
