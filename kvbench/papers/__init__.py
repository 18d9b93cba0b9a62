"""The seed papers' reported result tables, transcribed as data.

One CSV per table (``<paper>_<table>.csv``), long format, columns
``paper,table,model,method,budget,task,value,note``:

* ``model``  -- kvbench model name (``llama31_8b``, ``qwen25_7b``, ...) or a clear slug.
* ``method`` -- a kvbench policy spec (``snapkv``, ``h2o+caote``, ``cake+slake``, ...). Settings
  that differ from the paper's main setting are appended in brackets, e.g.
  ``snapkv+calidrop[theta1=0.60,theta2=0.80]`` or ``h2o+obcache_key[gqa=sum]``; see
  :func:`split_method`.
* ``budget`` -- as the paper states it: ``2k``, ``128``, ``10pct``; ``full`` for the full cache,
  ``all`` for an average printed across budgets, ``na`` where a table has no budget.
* ``task``   -- benchmark dataset name (LongBench / RULER names), ``avg`` for a printed average
  column, ``ppl`` / ``ppl_gap`` for perplexity tables, ``<task>@<context>`` for length grids.
* ``note``   -- empty, or what a reader must know about the cell. A note containing
  :data:`AVG_MISMATCH` on an ``avg`` row marks a printed average that does not equal the mean of
  the printed task values (paper typo or garbled extraction); see README.md in this folder.

Numbers are stored exactly as printed (same scale, same digits).
"""

from __future__ import annotations

import functools
import io
import re
from importlib import resources

import pandas as pd

from kvbench.errors import KVBenchError, choose

COLUMNS = ["paper", "table", "model", "method", "budget", "task", "value", "note"]
AVG_MISMATCH = "[avg-mismatch]"
PAPERS = ("caote", "obcache", "calidrop", "slake")

CAPTIONS: dict[tuple[str, str], str] = {
    ("caote", "table2"): "LongBench (16 tasks + Avg.), Llama 3.1-8B / 3.2-3B-Instruct, budgets 2k and 4k, "
    "block-wise prefill (block 128); H2O/TOVA/SnapKV with(out) CAOTE / FastCAOTE",
    ("caote", "table3"): "LongBench, Qwen 2.5-7B-Instruct, budgets 2k and 4k (the extraction lost the 4k SnapKV "
    "+CAOTE/+FastCAOTE rows and all Qwen 2.5-3B rows; see README)",
    ("caote", "table4"): "Booksum perplexity gap to the dense model (lower is better), Llama 3.1-8B / 3.2-3B-Instruct, "
    "budgets 2k-8k; dense PPL from the caption stored as method=full task=ppl",
    ("caote", "table5"): "Needle-in-a-haystack accuracy (0-1 scale), Llama 3.1-8B / 3.2-3B-Instruct, budgets 2k-8k",
    ("caote", "table6"): "Compute-overhead ratio of CAOTE / FastCAOTE FLOPs to model FLOPs (Llama 3.1-8B, "
    "Appendix E), prefill by sequence length and generation by sequence length; no budget",
    ("caote", "table10"): "LongBench, Llama 3.1-8B / 3.2-3B-Instruct, budgets 6k and 8k, incl. Sink "
    "(budget labels lost in the extraction; 6k then 8k per Appendix F.2)",
    ("caote", "table11"): "LongBench, Qwen 2.5-7B / 2.5-3B-Instruct, budgets 6k and 8k (Sink only at 6k)",
    ("caote", "table12"): "Booksum perplexity gap to the dense model, Qwen 2.5-7B / 2.5-3B-Instruct, budget 2k; "
    "dense PPL from the caption stored as method=full task=ppl",
    ("caote", "table13"): "Needle-in-a-haystack accuracy (0-1 scale), Qwen 2.5-7B / 2.5-3B-Instruct, budget 6k",
    ("obcache", "table1"): "Needle-in-a-haystack (RULER niah_single_2, exact match over 250 samples, %), "
    "Llama-3.1-8B-Instruct, 4k-32k contexts x 80-400 token budgets; Avg. over all 16 cells "
    "(budget=all); KV stored per query head (SnapKV layout)",
    ("obcache", "table3"): "GQA-aware OBCache scores (method suffix [gqa=sum]) vs storing KV for all query heads "
    "(plain spec, as in Tables 1/4/5), Llama-3.1-8B-Instruct; NIAH 8k @ 80 tokens, "
    "LongBench tasks @ 10% budget",
    ("obcache", "table4"): "LongBench (16 tasks, no Avg. printed), Llama-3.1-8B-Instruct, 5/10/20% KV budgets, "
    "one-shot prefill eviction; H2O/TOVA/SnapKV with OBCache value/key/joint scores",
    ("obcache", "table5"): "LongBench (16 tasks, no Avg. printed), Qwen-2.5-7B-Instruct, 5/10/20% KV budgets",
    ("calidrop", "table1"): "LongBench (13 tasks + Avg.), Mistral-7B-Instruct and LLaMA-3-8B-Instruct, KV size 64 "
    "and 128; StreamingLLM (sink)/H2O/SnapKV with(out) CaliDrop (theta1=0.7, theta2=0.85)",
    ("calidrop", "table2"): "CaliDrop threshold sweep: theta1 (left, L) x theta2 (right, R), LongBench 13 tasks, "
    "LLaMA-3-8B-Instruct, SnapKV, KV size 128",
    ("calidrop", "table4"): "LongBench (13 tasks + Avg.), Mistral-7B-Instruct / LLaMA-3-8B-Instruct at KV 256 and "
    "512, LLaMA-3-70B-Instruct at KV 64",
    ("calidrop", "table5"): "RULER (11 tasks + Avg.), LLaMA-3-8B-Instruct, KV size 64-512",
    ("calidrop", "table6"): "RULER (11 tasks + Avg.), Mistral-7B-Instruct, KV size 64-512",
    ("calidrop", "niah_text"): "Needle-in-a-haystack accuracy (%) quoted in the text for the heatmaps of Figs. 2 and "
    "9-11, LLaMA-3-8B-Instruct at 8k: H2O and SnapKV with(out) CaliDrop; the H2O pair is "
    "stated at KV 128 (§4.2.3) and at KV 96 (App. G), stored at both",
    ("slake", "table1"): "LongBench (16 tasks + Avg.), Llama2-7B-chat / Llama3.1-8B / Mistral-7B-v0.3, average "
    "per-layer budget 128 and 256; H2O, PyramidKV, CAKE, SLAKE (CAKE eviction + PTAA + VABS); "
    "Falcon Mamba-7B as a linear-complexity baseline",
    ("slake", "table2"): "Ablation, LongBench Avg., Llama2-7B: CAKE eviction only, + PTAA, + PTAA + VABS "
    "(budget not printed; 128 inferred)",
    ("slake", "table4"): "NeedleBench multi-needle reasoning at 8k context, EN / ZH / Overall (avg), "
    "full KV vs SLAKE at budgets 128 and 256",
}

MAIN_SETTINGS: dict[str, dict[str, str]] = {
    # CaliDrop §4.1: "θ1 = 0.7, θ2 = 0.85"; Table 2 varies them.
    "calidrop": {"theta1": "0.7", "theta2": "0.85"},
    # OBCache App. B.5: "we follow the SnapKV implementation, which stores the KV cache for all query heads";
    # Table 3 adds the GQA-aware scores (gqa=sum).
    "obcache": {"gqa": "repeat"},
    # SLAKE §3 (Fig. 1): VABS allocates SLAKE's layer budgets; Table 2 ablates it (a SPEC:key applies to that spec).
    "slake": {"cake+slake:layer_budget": "vabs"},
}
"""Per paper, the main value of every setting its tables vary in bracketed rows: a method printed without
brackets was run at these values."""

SCALES = {("caote", "table5"): 0.01, ("caote", "table13"): 0.01}
"""Tables printed on another scale than our 0–100 scores (CAOTE's needle accuracy is 0–1)."""

ALIASES = {
    ("needlebench", "reasoning_en"): "needlebench_multi_reasoning_en",
    ("needlebench", "reasoning_zh"): "needlebench_multi_reasoning_zh",
}
"""(task, score) → the name a paper table uses for it."""

AVERAGED_TASKS = {("slake", "table2"): ("slake", "table1")}
"""Tables that print only averages -> the table whose tasks they average (SLAKE Table 2's full-SLAKE 29.76 is
Table 1's LongBench Avg. of SLAKE at 128)."""

_TABLE_NO = re.compile(r"table(\d+)$")


def _sort_key(key: tuple[str, str]):
    paper, table = key
    m = _TABLE_NO.match(table)
    return (PAPERS.index(paper) if paper in PAPERS else len(PAPERS), paper, int(m.group(1)) if m else 0, table)


@functools.cache
def exponents(source: str) -> dict[str, dict[int, tuple[float, float]]]:
    """A layer-budget method's published exponent pairs per model id and average per-layer budget, from
    ``settings/exponents.csv``: ``cake`` (CAKE's released (tau1, tau2)) or ``slake_table3`` (SLAKE's VABS
    (alpha, beta))."""
    text = resources.files(__name__).joinpath("settings", "exponents.csv").read_text(encoding="utf-8")
    rows = pd.read_csv(io.StringIO(text))
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for row in rows[rows.source == source].itertuples():
        table.setdefault(str(row.model_id), {})[int(row.budget)] = (float(row.first), float(row.second))
    return table


def list_tables() -> list[tuple[str, str]]:
    """All transcribed tables as ``(paper, table)`` pairs, in paper order then table number."""
    return sorted(CAPTIONS, key=_sort_key)


def _check(paper: str, table: str) -> None:
    choose("paper", paper, {p for p, _ in CAPTIONS})
    choose(f"table for paper {paper!r}", table, {t for p, t in CAPTIONS if p == paper})


def table_caption(paper: str, table: str) -> str:
    """A short caption for a transcribed table."""
    _check(paper, table)
    return CAPTIONS[(paper, table)]


@functools.cache
def _read(paper: str, table: str) -> pd.DataFrame:
    name = f"{paper}_{table}.csv"
    try:
        text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    except FileNotFoundError as e:  # pragma: no cover - packaging error
        raise KVBenchError(f"paper table file {name} is missing from the kvbench installation") from e
    df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    if list(df.columns) != COLUMNS:
        raise KVBenchError(f"{name}: columns {list(df.columns)} != {COLUMNS}")
    df["value"] = pd.to_numeric(df["value"], errors="raise").astype(float)
    return df


def load_table(paper: str, table: str) -> pd.DataFrame:
    """One transcribed table as a long-format DataFrame (a fresh copy each call).

    Raises :class:`kvbench.errors.KVBenchError` naming the valid choices for an unknown
    paper or table.
    """
    _check(paper, table)
    return _read(paper, table).copy()


def load_all() -> pd.DataFrame:
    """All transcribed tables concatenated."""
    return pd.concat([load_table(p, t) for p, t in list_tables()], ignore_index=True)


_BRACKET = re.compile(r"^(?P<spec>[^\[\]]+)(?:\[(?P<params>[^\[\]]*)\])?$")


def split_method(method: str) -> tuple[str, dict[str, str]]:
    """Split ``"snapkv+calidrop[theta1=0.60,theta2=0.80]"`` into the policy spec and its settings.

    >>> split_method("snapkv+calidrop[theta1=0.60,theta2=0.80]")
    ('snapkv+calidrop', {'theta1': '0.60', 'theta2': '0.80'})
    >>> split_method("h2o")
    ('h2o', {})
    """
    m = _BRACKET.match(method)
    if not m:
        raise KVBenchError(f"malformed method {method!r}; expected spec or spec[key=value,...]")
    params: dict[str, str] = {}
    if m.group("params"):
        for item in m.group("params").split(","):
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise KVBenchError(f"malformed setting {item!r} in method {method!r}")
            params[k] = v
    return m.group("spec"), params


__all__ = [
    "AVG_MISMATCH",
    "CAPTIONS",
    "COLUMNS",
    "MAIN_SETTINGS",
    "PAPERS",
    "list_tables",
    "load_all",
    "load_table",
    "split_method",
    "table_caption",
]
