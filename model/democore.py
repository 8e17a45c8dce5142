"""A small CORE bundle made from the demo corpus's validation shard, so `core_bundle = "demo"` needs no download.

Tasks, in the standard bundle layout (see model.core), all from sentences the model never trained on:
- demo_last_word (language_modeling, 0-shot): a sentence without its last word; the word is the answer.
- demo_next_sentence (multiple_choice, 0-shot) and demo_next_sentence_2shot (2-shot): a sentence; the
  choices are the sentence that really follows it and three sentences from elsewhere.
- demo_which_context (schema, 0-shot): a sentence; the options are the sentence that really precedes it
  and two sentences from elsewhere.
Sentences are kept when plain: a capital first, a full stop last, 4 to 30 words, letters, digits and
light punctuation only. Everything is drawn with fixed seeds from the deterministic demo corpus, so the
bundle is the same wherever the same Python is installed. It is built once (locked, atomic) next to the
demo corpus: cache_dir/../data/demo-core-vN.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from model.data.demo_text import build_demo_corpus
from model.data.files import build_once

__all__ = ["DEMO_CORE_VERSION", "build_demo_bundle", "resolve_bundle"]

DEMO_CORE_VERSION = 1
MAX_EXAMPLES = 300  # per task
_SENTENCE = re.compile(r"[A-Z][A-Za-z0-9 ,;:'()\"-]*[a-z]\.")
_BREAK = re.compile(r"(?<=[a-z)]\.)\s+(?=[A-Z])")


def _plain(sentence: str) -> bool:
    return bool(_SENTENCE.fullmatch(sentence)) and 4 <= len(sentence.split()) <= 30


def _sentences(texts: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Plain sentences, and pairs of plain sentences that follow each other in one paragraph."""
    singles: list[str] = []
    pairs: list[tuple[str, str]] = []
    for text in texts:
        for para in text.split("\n\n"):
            sents = _BREAK.split(" ".join(para.split()))
            singles += [s for s in sents if _plain(s)]
            pairs += [(a, b) for a, b in zip(sents, sents[1:], strict=False) if _plain(a) and _plain(b)]
    return singles, pairs


def _with_gold(right: str, others: list[str], rng: random.Random) -> tuple[list[str], int]:
    options = [right, *others]
    rng.shuffle(options)
    return options, options.index(right)


def _tasks(singles: list[str], pairs: list[tuple[str, str]]) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(DEMO_CORE_VERSION)
    last_word = []
    for s in singles:
        words = s[:-1].split()
        if len(words) >= 5 and words[-1].isalpha():
            last_word.append({"context": " ".join(words[:-1]), "continuation": words[-1]})
    rng.shuffle(last_word)
    picked = rng.sample(pairs, min(MAX_EXAMPLES, len(pairs)))
    next_sentence, which_context = [], []
    for first, second in picked:
        elsewhere = [s for s in rng.sample(singles, 8) if s not in (first, second)]
        choices, gold = _with_gold(second, elsewhere[:3], rng)
        next_sentence.append({"query": first, "choices": choices, "gold": gold})
        options, gold = _with_gold(first, elsewhere[3:5], rng)
        which_context.append({"context_options": options, "continuation": second, "gold": gold})
    return {"last_word": last_word[:MAX_EXAMPLES], "next_sentence": next_sentence,
            "which_context": which_context}


# (label, icl_task_type, data file, num_fewshot, random baseline in percent)
_TASK_LIST = [
    ("demo_last_word", "language_modeling", "last_word", 0, 0.0),
    ("demo_next_sentence", "multiple_choice", "next_sentence", 0, 25.0),
    ("demo_next_sentence_2shot", "multiple_choice", "next_sentence", 2, 25.0),
    ("demo_which_context", "schema", "which_context", 0, 100.0 / 3),
]


def build_demo_bundle(cache_dir: str | Path = "runs/cache") -> Path:
    """The demo bundle's directory, built on first use from the demo corpus (itself built if missing)."""
    data = Path(cache_dir).parent / "data"
    out = data / f"demo-core-v{DEMO_CORE_VERSION}"

    def build(tmp: Path) -> None:
        corpus = build_demo_corpus(data / "demo")
        val = sorted(corpus.glob("shard_*.parquet"))[-1]  # the corpus's validation shard
        singles, pairs = _sentences(pq.read_table(val, columns=["text"]).column("text").to_pylist())
        (tmp / "eval_data" / "demo").mkdir(parents=True)
        for name, examples in _tasks(singles, pairs).items():
            lines = "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples)
            (tmp / "eval_data" / "demo" / f"{name}.jsonl").write_text(lines, encoding="utf-8")
        entries = [f"  - label: {label}\n    dataset_uri: demo/{name}.jsonl\n    num_fewshot: [{shots}]\n"
                   f"    icl_task_type: {kind}\n    continuation_delimiter: ' '\n"
                   for label, kind, name, shots, _ in _TASK_LIST]
        (tmp / "core.yaml").write_text("icl_tasks:\n" + "".join(entries), encoding="utf-8")
        rows = "".join(f"{label},{base:.4f}\n" for label, _, _, _, base in _TASK_LIST)
        (tmp / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n" + rows, encoding="utf-8")

    build_once(out, build)
    return out


def resolve_bundle(bundle: str, cache_dir: str | Path = "runs/cache") -> Path:
    """The directory a core_bundle setting names: "demo" builds the demo bundle, anything else is a path."""
    return build_demo_bundle(cache_dir) if bundle == "demo" else Path(bundle).expanduser()
