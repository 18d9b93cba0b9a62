"""Token-for-token parity with KVCache-Factory, the pipeline the papers' baseline rows came from.

The fixtures (``parity/kvcache_factory/<method>_multi_news.json`` in the workplace's shared data, or
``$KVBENCH_PARITY_DIR``) were measured with KVCache-Factory c97f9d7 on SmolLM2-135M float32 weights: for three
LongBench multi_news records, the prompt ids, the positions each layer and query head kept after prefill, and the
greedy output ids. kvbench runs the same records through its run path with ``+compat=kvcache_factory`` and must
reproduce all three exactly. The kept sets and prompts of every record are checked by default, and the 512-token
generation of the first record for H2O (scores accumulated while decoding); the other generations (45 s each on two
cores; SnapKV's, which evicts once, among them) run with the slow tests. In grouped mode, the four methods prefill each
record together, keep the same sets and start the reference's generation of every record (16 tokens) by default.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache

import pytest

from kvbench.config import compose
from kvbench.engine.shared import generate_shared
from kvbench.job import resolve
from kvbench.models import load_model
from kvbench.run import build_engine, build_task, run_sample, stop_ids
from tests.helpers import local_data

FIXTURES = local_data("KVBENCH_PARITY_DIR", "parity") / "kvcache_factory"
LONGBENCH = local_data("KVBENCH_LONGBENCH_DIR", "data", "longbench") / "multi_news.jsonl"
METHODS = {"snapkv": "snapkv", "pyramidkv": "pyramidkv", "h2o": "h2o", "streamingllm": "sink"}

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        not (FIXTURES.is_dir() and LONGBENCH.is_file()), reason="KVCache-Factory fixtures or LongBench data absent"
    ),
]


@cache
def fixture(method: str) -> dict:
    return json.loads((FIXTURES / f"{method}_multi_news.json").read_text())


@cache
def prepared(method: str, data_dir: str):
    """The engine, task and samples of the fixture's records under ``+compat=kvcache_factory``."""
    job = resolve(
        compose(
            [
                "+compat=kvcache_factory",
                "model=smollm2_135m",
                f"policy={METHODS[method]}",
                "budget=128",
                "task=longbench",
                "task.datasets=[multi_news]",
                f"task.data_dir={data_dir}",
                "task.max_length=1800",
                "engine.save_kept=true",
            ]
        )
    )
    loaded = load_model(job.model)
    task = build_task(job.cfg, loaded.tokenizer)
    return build_engine(job, loaded), task, loaded, list(task.samples())


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory):
    """A LongBench folder holding the fixture's three records (the same for every method), in fixture order."""
    folder = tmp_path_factory.mktemp("multi_news")
    wanted = [record["_id"] for record in fixture("snapkv")["records"]]
    lines = {json.loads(line)["_id"]: line for line in LONGBENCH.read_text(encoding="utf-8").splitlines()}
    (folder / "multi_news.jsonl").write_text("\n".join(lines[_id] for _id in wanted) + "\n", encoding="utf-8")
    return str(folder)


@pytest.mark.parametrize("method", METHODS)
def test_prompts_and_kept_sets_equal_the_reference(method, records_dir):
    engine, _, _, samples = prepared(method, records_dir)
    for sample, reference in zip(samples, fixture(method)["records"], strict=True):
        assert sample.id == reference["_id"] and sample.input_ids == reference["prompt_ids"]
        cache = engine.new_cache(len(sample.input_ids))
        engine.prefill(cache, sample.input_ids)
        kept = [positions[0].tolist() for positions in cache.kept_positions()]
        assert kept == reference["kept"], f"{method} {sample.id}: kept sets differ"  # [layer][query head], sorted


def generations_agree(method: str, records_dir: str, index: int, tokens: int | None = None) -> None:
    """The record's kept sets and generation (its first ``tokens``, else the whole) equal the reference's."""
    engine, task, loaded, samples = prepared(method, records_dir)
    reference = fixture(method)["records"][index]
    sample = samples[index] if tokens is None else replace(samples[index], max_new_tokens=tokens)
    _, output = run_sample(engine, task, sample, loaded)
    assert output.kept == reference["kept"]
    assert output.token_ids == reference["output_ids"][:tokens]


#: the methods whose first generation CI follows, for its first 128 of 512 tokens (the slow tests: all of it)
DEFAULT_GENERATIONS = ("h2o",)


@pytest.mark.parametrize(
    "method",
    [method if method in DEFAULT_GENERATIONS else pytest.param(method, marks=pytest.mark.slow) for method in METHODS],
)
def test_first_generation_equals_the_reference(method, records_dir):
    generations_agree(method, records_dir, 0, 128 if method in DEFAULT_GENERATIONS else None)


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_every_generation_equals_the_reference(method, index, records_dir):
    generations_agree(method, records_dir, index)


def test_a_grouped_sweeps_shared_prefill_gives_the_reference(records_dir):
    """Grouped mode: the four methods prefilling each record together (``generate_shared``, as a sweep sharing its
    prefills runs them: one forward for all four) keep the reference's sets, and start the reference's generation:
    16 tokens of the first record, the first token of the others (test_first_generation_equals_the_reference and the
    slow test_every_generation_equals_the_reference follow each further)."""
    engines = [prepared(method, records_dir)[0] for method in METHODS]
    _, _, loaded, samples = prepared("snapkv", records_dir)
    for index, sample in enumerate(samples):
        tokens = 16 if index == 0 else 1
        outputs = generate_shared(engines, sample.input_ids, tokens, stop_ids(sample, loaded), sample.min_new_tokens)
        assert [output.prefill_shared_by for output in outputs] == [4, 4, 4, 4]
        for method, output in zip(METHODS, outputs):
            reference = fixture(method)["records"][index]
            assert output.kept == reference["kept"], f"{method} {sample.id}: kept sets differ"
            assert output.token_ids == reference["output_ids"][:tokens], f"{method} {sample.id}"
