"""Tables rendered as Markdown, CSV or LaTeX (booktabs, compiled by pdflatex), printed and written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import file_name
from kvbench.errors import choose

FORMATS = {"markdown": "md", "csv": "csv", "latex": "tex"}


#: LaTeX's specials, escaped, and the non-ASCII symbols tables print, as text or math that pdflatex compiles
LATEX_ESCAPES = {
    **{char: f"\\{char}" for char in "&%$#_{}"},
    "\\": r"\textbackslash{}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "–": "--",
    "—": "---",
    "−": "$-$",
    "Δ": r"$\Delta$",
    "θ": r"$\theta$",
    "×": r"$\times$",
    "→": r"$\rightarrow$",
    "§": r"\S{}",
    "±": r"$\pm$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
}


def latex_text(text: str) -> str:
    """``text`` as LaTeX source: specials escaped, symbols in text or math mode."""
    return "".join(LATEX_ESCAPES.get(char, char) for char in text)


def latex_table(table: pd.DataFrame, decimals: int) -> str:
    """A booktabs ``tabular`` (``\\usepackage{booktabs}``): names escaped, numbers right-aligned with ``decimals``
    places, empty cells ``--``."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "--"
        if isinstance(value, float):
            return f"{value:.{decimals}f}"
        return latex_text(str(value))

    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in table.dtypes]
    lines = [
        r"\begin{tabular}{" + "".join("r" if number else "l" for number in numeric) + "}",
        r"\toprule",
        " & ".join(latex_text(str(name)) for name in table.columns) + r" \\",
        r"\midrule",
        *(" & ".join(cell(value) for value in row) + r" \\" for row in table.astype(object).itertuples(index=False)),
        r"\bottomrule",
        r"\end{tabular}",
    ]
    return "\n".join(lines) + "\n"


def render(table: pd.DataFrame, fmt: str, decimals: int = 2) -> str:
    """A table as Markdown, CSV or LaTeX; numbers with ``decimals`` places, empty cells as ``–``."""
    choose("format", fmt, FORMATS)
    if fmt == "csv":
        return table.to_csv(index=False)
    if fmt == "latex":
        return latex_table(table, decimals)
    cells = table.astype(object).where(table.notna(), None)  # tabulate prints None, not NaN, as missingval
    return cells.to_markdown(index=False, floatfmt=f".{decimals}f", missingval="–")


def write_tables(tables: dict[str, str], output_dir: Path, fmt: str) -> list[Path]:
    """Write rendered tables as ``<output_dir>/<name>.<md|csv|tex>`` (the name made a file name inside
    ``output_dir``: it may come from a run directory); returns the paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in tables.items():
        path = output_dir / file_name(name, f".{FORMATS[fmt]}")
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def print_tables(
    tables: dict[str, pd.DataFrame], fmt: str, output_dir: Path | None, titles: Callable[[str], str] = str
) -> None:
    """Print each table rendered in ``fmt`` (Markdown under its heading, ``titles(name)``), and write them to
    ``output_dir`` if given."""
    rendered = {name: render(table, fmt) for name, table in tables.items()}
    for name, text in rendered.items():
        if fmt == "markdown":
            print(f"\n### {titles(name)}\n")
        print(text.rstrip("\n"))
    if output_dir:
        for path in write_tables(rendered, output_dir, fmt):
            print(f"wrote {path}")
