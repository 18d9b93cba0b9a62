"""The official LongBench v1 metrics, reimplemented to score exactly as THUDM's ``eval.py``.

Every metric has the signature ``metric(prediction, ground_truth, all_classes=None) -> float`` and
reproduces the official function of the same role, quirks included (each quirk is noted where it
lives). :func:`score_sample` is what ``eval.py`` adds to a dataset's total for one sample: the
first-line rule for the few-shot datasets, then the best score over the reference answers.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
import sys
from collections import Counter
from collections.abc import Callable

import jieba
from rouge import Rouge

from kvbench.errors import choose

jieba.setLogLevel(logging.WARNING)

Metric = Callable[..., float]

# The official Chinese punctuation set, by Unicode block. It lacks "《" (U+300A) and the full-width
# full stop "．" (U+FF0E); both therefore survive normalisation, as they do in the official scorer.
_ZH_PUNCTUATION = (
    "–—‘’‛“”„‟…‧"  # General Punctuation
    "、。〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"  # CJK Symbols and Punctuation
    "﹏"  # Small Form Variants
    "！＂＃＄％＆＇（）＊＋，－／：；＜＝＞？＠［＼］＾＿｀｛｜｝～｟｠｡｢｣､"  # Half/Full-width Forms
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)

# Datasets whose prediction is cut to its first line before scoring (few-shot tasks, whose
# models tend to continue with another example).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def normalize_answer(text: str) -> str:
    """English answer normalisation: lower case, drop ASCII punctuation, articles, extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese answer normalisation: lower case, drop ASCII and Chinese punctuation and all spaces."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION).split())


def _token_f1(prediction_tokens: list[str], ground_truth_tokens: list[str]) -> float:
    """Bag-of-tokens F1 between two token lists."""
    same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Token F1 after :func:`normalize_answer` (whitespace tokens)."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _zh_tokens(text: str) -> list[str]:
    """jieba words, each normalised, the empty ones dropped."""
    words = (normalize_zh_answer(word) for word in jieba.cut(text, cut_all=False))
    return [word for word in words if word]


def qa_f1_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Token F1 over jieba words, each normalised with :func:`normalize_zh_answer`."""
    return _token_f1(_zh_tokens(prediction), _zh_tokens(ground_truth))


def _headroom() -> int:
    """How many more nested Python calls fit under the recursion limit, seen from the caller."""

    def dive(level: int) -> int:
        try:
            return dive(level + 1)
        except RecursionError:
            return level

    return dive(0)


def _rouge_l_as_official(prediction: str, ground_truth: str, official_frames: int) -> float:
    """``Rouge().get_scores(...)["rouge-l"]["f"]``, 0 on any exception, with the official stack room.

    The ``rouge`` package rebuilds the longest common subsequence recursively, so a long sentence
    pair raises ``RecursionError``, which the official scorer turns into a score of 0 (it happens in
    practice: Chinese summaries have no ASCII full stop and form one long "sentence"). Whether it
    raises depends on how much room is left on the stack. The official ``eval.py`` calls
    ``get_scores`` from a pure-Python stack ``official_frames`` deep under the default limit of 1000;
    the limit is shifted here, for this call only, so that exactly the same room is left, however
    deep (and through whatever C calls) this function was reached. The limit is process-wide: do not
    score from several threads at once.
    """
    official_room = 1000 - official_frames - 2  # _headroom() and dive(0) are two frames themselves
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + official_room - _headroom())
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0
    finally:
        sys.setrecursionlimit(limit)


def rouge_l(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F of the ``rouge`` package (sentences split at ".", words at spaces), 0 on error."""
    # Official stack at this point: the eval.py module, scorer(), rouge_score().
    return _rouge_l_as_official(prediction, ground_truth, official_frames=3)


def rouge_l_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """ROUGE-L F over jieba words joined with spaces."""
    prediction = " ".join(jieba.cut(prediction, cut_all=False))
    ground_truth = " ".join(jieba.cut(ground_truth, cut_all=False))
    # Official stack at this point: the eval.py module, scorer(), rouge_zh_score(), rouge_score().
    return _rouge_l_as_official(prediction, ground_truth, official_frames=4)


def classification(prediction: str, ground_truth: str, all_classes=None) -> float:
    """1/k if the true class is among the k class names found in the prediction, else 0.

    Class names that are proper substrings of the true class are dropped from the matches, but the
    official loop removes items from the list it is iterating over, so the item after each removed
    one is skipped (and kept); the same walk is reproduced here. The official fallback to the
    closest class by ``difflib`` similarity is unreachable (it tests ``list != 0``), so a prediction
    naming no class scores 0.
    """
    matches = [name for name in all_classes if name in prediction]
    position = 0
    while position < len(matches):
        name = matches[position]
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
        position += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_of(prediction: str, target: str) -> float:
    """The fraction of the numbers in ``prediction`` that equal ``target`` (0 with no numbers)."""
    numbers = re.findall(r"\d+", prediction)
    return numbers.count(target) / len(numbers) if numbers else 0.0


def count(prediction: str, ground_truth: str, all_classes=None) -> float:
    """passage_count: the fraction of numbers in the prediction equal to the true count."""
    return _share_of(prediction, str(ground_truth))


def retrieval(prediction: str, ground_truth: str, all_classes=None) -> float:
    """passage_retrieval_en: the fraction of numbers in the prediction equal to "Paragraph N"'s N."""
    return _share_of(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh(prediction: str, ground_truth: str, all_classes=None) -> float:
    """passage_retrieval_zh: the fraction of numbers in the prediction equal to "段落N"'s N."""
    return _share_of(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def _fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` on its pure-Python ``difflib`` backend, which the official ran.

    Written out so that an installed ``python-Levenshtein`` (a different similarity) cannot change
    scores: equal strings give 100, one empty string gives 0, else the rounded difflib ratio.
    """
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, ground_truth: str, all_classes=None) -> float:
    """Edit similarity (0-1) of the next line of code.

    The predicted line is the first line (after leading newlines) containing none of "`", "#" and
    "//" anywhere in it; with no such line the prediction is the empty string.
    """
    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return _fuzz_ratio(line, ground_truth) / 100


DATASET_METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "dureader": rouge_l_zh,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "vcsum": rouge_l_zh,
    "trec": classification,
    "triviaqa": qa_f1,
    "samsum": rouge_l,
    "lsht": classification,
    "passage_count": count,
    "passage_retrieval_en": retrieval,
    "passage_retrieval_zh": retrieval_zh,
    "lcc": code_sim,
    "repobench-p": code_sim,
}


def score_sample(dataset: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """The score (0-1) the official ``eval.py`` adds for one sample of ``dataset``.

    For trec, triviaqa, samsum and lsht only the first line of the prediction (after leading
    newlines) is scored; the score is the maximum over the reference ``answers`` (0 with none).
    """
    choose("LongBench dataset", dataset, DATASET_METRIC)
    metric = DATASET_METRIC[dataset]
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max((metric(prediction, answer, all_classes) for answer in answers), default=0.0)


def length_bucket(length: int) -> str:
    """The LongBench-E bucket of a record's ``length`` (words; characters for Chinese text):
    "0-4k" (< 4000), "4-8k" (< 8000) or "8k+"."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"
