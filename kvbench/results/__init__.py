"""Run directories and what is made from them: tables, paper comparisons, plots, W&B."""
