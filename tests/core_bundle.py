"""Small CORE bundles written by the tests, and a hand-built model whose answers can be worked out by hand.

The tokenizer is the project's own with no merges (one token per byte, BOS = 256), so every character is
one token. BigramModel's logits depend only on the current token:
- after any token it prefers "a" (logit 4, every other token 0);
- after ":" it prefers " " (logit 8) over "a";
- after "!" it has no preference (all logits 0; greedy picks token 0).
So a multiple-choice answer wins by its share of "a"s, a schema option loses when it ends in "!", and a
language-modelling continuation is right exactly when it is " " (after "Q:") followed by only "a"s.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.data import Tokenizer

BYTE_VOCAB = 257


def byte_tokenizer() -> Tokenizer:
    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)})


class BigramModel(nn.Module):
    """ids (B, T) -> logits (B, T, 257), a fixed table lookup; counts its forward calls and input shapes."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.zeros(BYTE_VOCAB, BYTE_VOCAB)
        table[:, ord("a")] = 4.0
        table[ord(":"), ord(" ")] = 8.0
        table[ord("!")] = 0.0
        self.register_buffer("table", table)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(idx.shape))
        return self.table[idx]


class RecallModel(nn.Module):
    """ids (B, T) -> logits (B, T, 257): 4 for every token seen at or before the position (BOS included), 0 for
    the rest. So with m distinct tokens seen, the next token costs ln(m e^4 + 257 - m) nats, 4 less if seen;
    and greedy decoding writes the smallest token id seen so far (argmax takes the first of equal logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(idx.shape))
        return 4.0 * F.one_hot(idx, BYTE_VOCAB).cummax(dim=1).values.float()


def _line(row: Any) -> str:
    if not isinstance(row, str):
        return json.dumps(row) + "\n"
    return row if row.endswith(("\n", "\r")) else row + "\n"


def write_bundle(root: Path, tasks: list[dict[str, Any]], data: dict[str, list[Any]],
                 baselines: dict[str, float]) -> Path:
    """tasks: core.yaml entries; data: dataset_uri -> JSON-able lines (a str is written verbatim, ending with
    "\\n" unless it ends with a line break of its own)."""
    (root / "eval_data").mkdir(parents=True, exist_ok=True)
    lines = ["icl_tasks:"]
    for t in tasks:
        lines.append(f"  - label: {t['label']}")
        lines += [f"    {k}: {json.dumps(v)}" for k, v in t.items() if k != "label"]
    (root / "core.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for uri, rows in data.items():
        path = root / "eval_data" / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(_line(r) for r in rows)
        path.write_bytes(text.encode("utf-8"))  # bytes: no newline translation
    with (root / "eval_meta_data.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows(baselines.items())
    return root


MC = [  # 3 of 4 right: the answer with most "a"s wins, and in the last one gold is not it
    {"query": "Q:", "choices": ["aaaa", "bbbb", "cccc", "dddd"], "gold": 0},
    {"query": "Q:", "choices": ["bab", "aaa", "bbb", "ccc"], "gold": 1},
    {"query": "Q:", "choices": ["xyz", "aax", "aaa", "qqq"], "gold": 2},
    {"query": "Q:", "choices": ["aaa", "bbb", "ccc", "ddd"], "gold": 3},
]
SCHEMA = [  # 3 of 4 right: the option not ending in "!" wins, and in the third one gold is the other
    {"context_options": ["ok!", "ok"], "continuation": "aaa", "gold": 1},
    {"context_options": ["no", "no!"], "continuation": "aaa", "gold": 0},
    {"context_options": ["yes", "yes!"], "continuation": "aaa", "gold": 1},
    {"context_options": ["a!", "b", "c!"], "continuation": "aaa", "gold": 1},
]
LM = [  # 2 of 4 right: greedy writes " aaa..." after "Q:"
    {"context": "Q:", "continuation": "aaa"},
    {"context": "Q: ", "continuation": "aa"},  # trailing space in the data is stripped, as in the reference
    {"context": "Q:", "continuation": "ab"},
    {"context": "Q:", "continuation": "ba"},
]
HAND_TASKS = [
    {"label": "mc", "dataset_uri": "mc.jsonl", "num_fewshot": [0], "icl_task_type": "multiple_choice",
     "continuation_delimiter": " "},
    {"label": "mc_2shot", "dataset_uri": "mc.jsonl", "num_fewshot": [2], "icl_task_type": "multiple_choice",
     "continuation_delimiter": " "},
    {"label": "schema", "dataset_uri": "sub/schema.jsonl", "num_fewshot": 0, "icl_task_type": "schema",
     "continuation_delimiter": ""},
    {"label": "lm", "dataset_uri": "lm.jsonl", "num_fewshot": [0], "icl_task_type": "language_modeling",
     "continuation_delimiter": " "},
]
HAND_BASELINES = {"mc": 25, "mc_2shot": 25, "schema": 50, "lm": 0}
# Worked out by hand from the model above: accuracy, then (acc - b) / (1 - b).
HAND_ACCURACY = {"mc": 0.75, "mc_2shot": 0.75, "schema": 0.75, "lm": 0.5}
HAND_CENTERED = {"mc": 2 / 3, "mc_2shot": 2 / 3, "schema": 0.5, "lm": 0.5}
HAND_CORE = (2 / 3 + 2 / 3 + 0.5 + 0.5) / 4


def write_hand_bundle(root: Path) -> Path:
    return write_bundle(root, HAND_TASKS, {"mc.jsonl": MC, "sub/schema.jsonl": SCHEMA, "lm.jsonl": LM},
                        HAND_BASELINES)
