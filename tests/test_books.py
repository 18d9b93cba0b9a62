"""PG19 / Booksum perplexity tasks: books from a local folder, a file or (mocked) hub rows."""

import math

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT, hub
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.tasks import books
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.books import BooksumTask, PG19Task
from tests.helpers import local_data

MODEL = ModelInfo("tiny_llama", byte_tokenizer(4096), 4096)
BOOK_A = (
    "*** START OF THIS PROJECT GUTENBERG EBOOK A ***\n"
    + "The river ran north past the mill. " * 60
    + "\n*** END OF THIS PROJECT GUTENBERG EBOOK A ***\nlicense"
)
BOOK_B = "Chapter one. " + "She opened the letter and read it twice. " * 40
BOOK_C = "Tiny."


def task_cfg(name, **overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / f"{name}.yaml")
    return OmegaConf.merge(cfg, overrides)


@pytest.fixture
def book_dir(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "b.txt").write_text(BOOK_B, encoding="utf-8")
    (folder / "a.txt").write_text(BOOK_A, encoding="utf-8")
    (folder / "c.txt").write_text(BOOK_C, encoding="utf-8")
    (folder / "notes.md").write_text("not a book", encoding="utf-8")
    return folder


def test_pg19_books_from_a_folder_in_name_order(book_dir):
    task = PG19Task(task_cfg("pg19", data_dir=str(book_dir), num_samples=2, max_tokens=500), MODEL)
    samples = list(task.samples())
    assert [s.id for s in samples] == ["pg19-0", "pg19-1"] and {s.subtask for s in samples} == {"pg19"}
    assert [s.metadata["book"] for s in samples] == ["a", "b"]
    assert all(s.mode == "perplexity" and len(s.input_ids) == 500 for s in samples)
    assert samples[0].input_ids[0] == MODEL.tokenizer.bos_token_id
    assert MODEL.tokenizer.decode(samples[0].input_ids[1:]) == BOOK_A.split("***\n", 1)[1][:499]  # header stripped


def test_whole_books_short_books_and_the_continuation_mode(book_dir):
    task = PG19Task(
        task_cfg("pg19", data_dir=str(book_dir), num_samples=None, max_tokens=None, context_tokens=100), MODEL
    )
    samples = list(task.samples())
    assert [s.metadata["book"] for s in samples] == ["a", "b"]  # c.txt (6 tokens) is too short to score
    assert len(samples[1].input_ids) == 1 + len(BOOK_B.strip())
    assert all(s.context_tokens == 100 for s in samples)
    record = task.evaluate(samples[1], [2.0] * (len(samples[1].input_ids) - 100))
    assert record["score"] == pytest.approx(math.exp(2.0)) and record["num_tokens"] == len(samples[1].input_ids) - 100
    assert task.aggregate([record, {**record, "nll": 1.0}]) == {
        "ppl": pytest.approx(math.exp(1.5)),
        "nll": pytest.approx(1.5),
    }


def test_booksum_from_a_single_file(book_dir):
    task = BooksumTask(task_cfg("booksum", path=str(book_dir / "b.txt"), max_tokens=64), MODEL)
    [sample] = list(task.samples())
    assert sample.id == "booksum-0" and sample.subtask == "booksum" and len(sample.input_ids) == 64


def test_hub_rows_use_the_configured_text_column(monkeypatch):
    calls, taken = [], []

    def fake_rows(repo, split, how, name=None):
        calls.append((repo, split, name))
        for row in (
            {"chapter": BOOK_B, "book_id": "Emma.chapter 1"},
            {"chapter": BOOK_A, "book_id": "Emma.chapter 2"},
            {"chapter": BOOK_A, "book_id": "never read"},
        ):
            taken.append(row["book_id"])
            yield row

    monkeypatch.setattr(books, "hub_rows", fake_rows)
    task = BooksumTask(task_cfg("booksum", num_samples=2, max_tokens=100), MODEL)
    samples = list(task.samples())
    assert calls == [("kmfoda/booksum", "test", None)] and taken == ["Emma.chapter 1", "Emma.chapter 2"]  # streamed
    assert [s.metadata["book"] for s in samples] == ["Emma.chapter 1", "Emma.chapter 2"]
    assert MODEL.tokenizer.decode(samples[0].input_ids[1:]) == BOOK_B[:99]
    task = BooksumTask(task_cfg("booksum", text_field="text"), MODEL)
    with pytest.raises(KVBenchError, match="has no column 'text'"):
        list(task.samples())


def test_min_tokens_skips_short_texts_and_a_text_is_scored_once(monkeypatch):
    """CAOTE Table 4: chapters longer than the largest budget only; Booksum repeats a chapter per summary source."""
    short, long_a, long_b = "Short chapter. " * 4, "A" * 500, "B" * 400
    rows = [("one", long_a), ("two", short), ("three", long_a), ("four", long_b), ("five", "C" * 600)]
    monkeypatch.setattr(
        books, "hub_rows", lambda *args, **kwargs: iter({"chapter": text, "book_id": title} for title, text in rows)
    )
    task = BooksumTask(task_cfg("booksum", num_samples=2, max_tokens=300, min_tokens=300), MODEL)
    samples = list(task.samples())
    assert [(s.id, s.metadata["book"], len(s.input_ids)) for s in samples] == [
        ("booksum-0", "one", 300),
        ("booksum-3", "four", 300),
    ]
    assert (
        len(list(BooksumTask(task_cfg("booksum", num_samples=9, max_tokens=300, min_tokens=300), MODEL).samples())) == 3
    )
    with pytest.raises(KVBenchError, match="task.min_tokens=301 is above task.max_tokens=300"):
        BooksumTask(task_cfg("booksum", max_tokens=300, min_tokens=301), MODEL)
    with pytest.raises(
        KVBenchError, match="no Booksum chapters with more than task.context_tokens=0 and at least task.min_tokens=700"
    ):
        list(BooksumTask(task_cfg("booksum", max_tokens=None, min_tokens=700), MODEL).samples())


def test_missing_data_is_a_one_line_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, cls in (("pg19", PG19Task), ("booksum", BooksumTask)):
        with pytest.raises(KVBenchError) as error:
            cls(task_cfg(name, data_dir=str(empty)), MODEL)
        assert "\n" not in str(error.value) and "task.data_dir=" in str(error.value)
        with pytest.raises(KVBenchError) as error:
            cls(task_cfg(name, path=str(tmp_path / "nowhere.txt")), MODEL)
        assert "\n" not in str(error.value) and "nowhere.txt" in str(error.value)
    monkeypatch.setattr(hub, "hub_online", lambda: False)
    with pytest.raises(KVBenchError) as error:
        list(PG19Task(task_cfg("pg19"), MODEL).samples())
    message = str(error.value)
    assert "\n" not in message and "emozilla/pg19" in message and "task.data_dir=FOLDER" in message
    with pytest.raises(KVBenchError, match=r"^task.num_samples=0: must be null \(every text\) or a sample count ≥ 1$"):
        PG19Task.check(dict(task_cfg("pg19", num_samples=0)))


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_perplexity_on_a_local_book():
    """End to end through the engine on a local book (KVBENCH_PPL_FILE), when it is present."""
    path = local_data("KVBENCH_PPL_FILE", "data", "gutenberg", "pride_and_prejudice.txt")
    if not path.is_file():
        pytest.skip(f"{path} is absent (set KVBENCH_PPL_FILE to a UTF-8 book)")
    from kvbench.engine import Engine
    from kvbench.models import load_model, model_config
    from kvbench.policies import build_policy

    loaded = load_model(model_config("smollm2_135m"))
    task = PG19Task(task_cfg("pg19", path=str(path), max_tokens=512), ModelInfo("smollm2_135m", loaded.tokenizer, 8192))
    [sample] = list(task.samples())
    engine = Engine(
        loaded.model, build_policy("full", {}), "8k", regime="chunked", block_size=256, attn_backend=loaded.attn_backend
    )
    record = task.evaluate(sample, engine.perplexity(sample.input_ids, sample.context_tokens).nlls)
    assert 5 < record["score"] < 100
