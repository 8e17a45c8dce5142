"""A stand-in for the competition kit's prepare.py, for tests, on the offline demo corpus.

The kit is not public; its closest public relative is autoresearch's prepare.py (karpathy/autoresearch,
MIT). This file is written afresh to that file's interface and semantics, which the adapter
(model/data/kit.py) and the tests rely on:
- constants MAX_SEQ_LEN (2048: evaluate_bpb always runs at it), EVAL_TOKENS (40 * 524288), VOCAB_SIZE
  (8192), the clock's constants under the competition kit's names (TRAIN_TIME_BUDGET_SECONDS 1800,
  TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS 900, TRAIN_STARTUP_STEPS_EXCLUDED 2; autoresearch's TIME_BUDGET too),
  which a training script reads and keeps itself (the stand-in has no clock of its own); four reserved
  special tokens with BOS = <|reserved_0|>, the pinned validation shard shard_06542.parquet among
  parquet shards with a `text` column;
- train_tokenizer(): a byte-level BPE of VOCAB_SIZE - 4 merged tokens trained with rustbpe on the
  training shards (documents capped at 10,000 characters), served by tiktoken with the specials after
  them, pickled as tokenizer/tokenizer.pkl; token_bytes.pt holds each token's length in bytes as
  len(decode([id]).encode()) (so a token holding part of a multi-byte character counts the three bytes
  of U+FFFD), 0 for the specials;
- Tokenizer.from_directory(), get_vocab_size(), get_bos_token_id(), encode(str | list, prepend=None),
  decode(); get_token_bytes(device);
- make_dataloader(tokenizer, B, T, split, buffer_size=1000): no rank, no device. Documents are read in
  file order (row group by row group, in batches of 128), each encoded with BOS in front; before each
  placement the buffer is topped up, a batch at a time, to at least buffer_size documents. A row of
  T + 1 tokens takes the first longest document that fits whole in what is left of it; when none fits
  it takes the first shortest, cropped to fill the row exactly (the rest is dropped). The stream is
  endless: after the last shard it starts over with the epoch counted up. It yields (inputs, targets,
  epoch): int64 (B, T) views of one buffer that the next batch overwrites;
- evaluate_bpb(model, tokenizer, batch_size): EVAL_TOKENS // (batch_size * MAX_SEQ_LEN) batches of the
  validation loader at MAX_SEQ_LEN, model(x, y, reduction="none") summed over targets with a positive
  byte length, over ln 2 times the summed byte lengths.

Unlike autoresearch it downloads nothing: `python prepare.py` fills DATA_DIR from trnsweep's offline demo
corpus (model.data.demo_text, the last shard pinned as the validation shard; tests/kit_standin does the
same from a corpus at hand) and trains the tokenizer, each only once. It keeps its data beside this file
(CACHE_DIR is this file's folder: copy the file into a fresh folder to make a kit) and runs on the CPU
(autoresearch pins the loader's buffer, copies it to "cuda" and reads token_bytes onto "cuda"). Tests
override the constants by rewriting their lines in the copy.
"""

import math
import os
import pickle

import pyarrow.parquet as pq
import torch

# ---- constants ----------------------------------------------------------------------------------
MAX_SEQ_LEN = 2048
TIME_BUDGET = 300
TRAIN_TIME_BUDGET_SECONDS = 1800
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = 900
TRAIN_STARTUP_STEPS_EXCLUDED = 2
EVAL_TOKENS = 20971520  # 40 * 524288
VOCAB_SIZE = 8192

CACHE_DIR = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(CACHE_DIR, "data")
TOKENIZER_DIR = os.path.join(CACHE_DIR, "tokenizer")
MAX_SHARD = 6542
VAL_SHARD = MAX_SHARD
VAL_FILENAME = f"shard_{VAL_SHARD:05d}.parquet"
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = [f"<|reserved_{i}|>" for i in range(4)]
BOS_TOKEN = SPECIAL_TOKENS[0]
DOC_BATCH = 128  # documents tokenised together, and the unit the packing buffer is topped up by


# ---- data and tokenizer ---------------------------------------------------------------------------

def list_parquet_files():
    names = sorted(n for n in os.listdir(DATA_DIR) if n.endswith(".parquet"))
    return [os.path.join(DATA_DIR, n) for n in names]


def _split_paths(split):
    paths = list_parquet_files()
    val = os.path.join(DATA_DIR, VAL_FILENAME)
    if split == "val":
        return [val]
    train = [p for p in paths if p != val]
    if not train:
        raise FileNotFoundError(f"no training shards in {DATA_DIR}")
    return train


def text_iterator(max_chars=1_000_000_000, doc_cap=10_000):
    """Training documents, each cut to doc_cap characters, until max_chars characters have gone by."""
    seen = 0
    for path in _split_paths("train"):
        f = pq.ParquetFile(path)
        for g in range(f.num_row_groups):
            for text in f.read_row_group(g).column("text").to_pylist():
                text = text[:doc_cap]
                seen += len(text)
                yield text
                if seen >= max_chars:
                    return


def train_tokenizer():
    """tokenizer.pkl and token_bytes.pt in TOKENIZER_DIR (kept when both exist)."""
    import rustbpe
    import tiktoken

    pkl = os.path.join(TOKENIZER_DIR, "tokenizer.pkl")
    lengths = os.path.join(TOKENIZER_DIR, "token_bytes.pt")
    if os.path.exists(pkl) and os.path.exists(lengths):
        return
    os.makedirs(TOKENIZER_DIR, exist_ok=True)
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(text_iterator(), VOCAB_SIZE - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="rustbpe", pat_str=bpe.get_pattern(), mergeable_ranks=ranks,
                            special_tokens=specials)
    with open(pkl, "wb") as f:
        pickle.dump(enc, f)
    counts = [0 if enc.decode([i]) in specials else len(enc.decode([i]).encode("utf-8"))
              for i in range(enc.n_vocab)]
    torch.save(torch.tensor(counts, dtype=torch.int32), lengths)
    probe = "Hello world! Numbers: 123. Unicode: 你好"
    assert enc.decode(enc.encode_ordinary(probe)) == probe


class Tokenizer:
    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

    @classmethod
    def from_directory(cls, tokenizer_dir=TOKENIZER_DIR):
        with open(os.path.join(tokenizer_dir, "tokenizer.pkl"), "rb") as f:
            return cls(pickle.load(f))

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode(self, text, prepend=None, num_threads=8):
        if prepend is not None and not isinstance(prepend, int):
            raise TypeError(f"prepend must be a token id, got {type(prepend)}")
        if isinstance(text, str):
            rows = [self.enc.encode_ordinary(text)]
        elif isinstance(text, list):
            rows = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
        else:
            raise ValueError(f"cannot encode a {type(text)}")
        if prepend is not None:
            rows = [[prepend, *r] for r in rows]
        return rows[0] if isinstance(text, str) else rows

    def decode(self, ids):
        return self.enc.decode(ids)


def get_token_bytes(device="cpu"):
    with open(os.path.join(TOKENIZER_DIR, "token_bytes.pt"), "rb") as f:
        return torch.load(f, map_location=device, weights_only=True)


# ---- the loader -----------------------------------------------------------------------------------

def _document_batches(split):
    """Endless (texts, epoch): DOC_BATCH documents at a time, row group by row group, epoch 1, 2, ..."""
    paths = _split_paths(split)
    epoch = 1
    while True:
        for path in paths:
            f = pq.ParquetFile(path)
            for g in range(f.num_row_groups):
                texts = f.read_row_group(g).column("text").to_pylist()
                for i in range(0, len(texts), DOC_BATCH):
                    yield texts[i:i + DOC_BATCH], epoch
        epoch += 1


def _best_fit(docs, room):
    """Index of the first of the longest documents no longer than room; -1 when none is."""
    best, best_len = -1, 0
    for i, doc in enumerate(docs):
        if best_len < len(doc) <= room:
            best, best_len = i, len(doc)
    return best


def make_dataloader(tokenizer, B, T, split, buffer_size=1000):
    """BOS-aligned best-fit rows of T + 1 tokens, B at a time (see the module doc)."""
    assert split in ("train", "val")
    width = T + 1
    bos = tokenizer.get_bos_token_id()
    source = _document_batches(split)
    docs = []
    state = {"epoch": 1}
    rows = torch.empty((B, width), dtype=torch.long)
    out = torch.empty(2 * B * T, dtype=torch.long)
    inputs, targets = out[:B * T].view(B, T), out[B * T:].view(B, T)

    def top_up():
        while len(docs) < buffer_size:
            texts, state["epoch"] = next(source)
            docs.extend(tokenizer.encode(texts, prepend=bos))

    while True:
        for r in range(B):
            filled = 0
            while filled < width:
                top_up()
                room = width - filled
                i = _best_fit(docs, room)
                if i < 0:  # nothing fits whole: the first shortest, cropped to the room left
                    i = min(range(len(docs)), key=lambda j: len(docs[j]))
                piece = docs.pop(i)[:room]
                rows[r, filled:filled + len(piece)] = torch.tensor(piece, dtype=torch.long)
                filled += len(piece)
        inputs.copy_(rows[:, :-1])
        targets.copy_(rows[:, 1:])
        yield inputs, targets, state["epoch"]


# ---- the metric -----------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_bpb(model, tokenizer, batch_size):
    """Bits per byte over the first EVAL_TOKENS // MAX_SEQ_LEN rows (whole batches) of the validation split."""
    token_bytes = get_token_bytes(device="cpu")
    loader = make_dataloader(tokenizer, batch_size, MAX_SEQ_LEN, "val")
    nats, nbytes = 0.0, 0
    for _ in range(EVAL_TOKENS // (batch_size * MAX_SEQ_LEN)):
        x, y, _ = next(loader)
        loss = model(x, y, reduction="none").view(-1)
        lengths = token_bytes[y.view(-1)]
        nats += (loss * (lengths > 0)).sum().item()
        nbytes += lengths.sum().item()
    return nats / (math.log(2) * nbytes)


def fill_data(corpus_dir):
    """DATA_DIR from a folder of parquet shards (kept when it holds shards): all but the last as training
    shards, the last as VAL_FILENAME."""
    import shutil

    if os.path.isdir(DATA_DIR) and any(n.endswith(".parquet") for n in os.listdir(DATA_DIR)):
        return
    shards = sorted(n for n in os.listdir(corpus_dir) if n.startswith("shard_") and n.endswith(".parquet"))
    if len(shards) < 2:
        raise FileNotFoundError(f"{corpus_dir}: fewer than two parquet shards")
    tmp = DATA_DIR + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in shards[:-1]:
        shutil.copyfile(os.path.join(corpus_dir, name), os.path.join(tmp, name))
    shutil.copyfile(os.path.join(corpus_dir, shards[-1]), os.path.join(tmp, VAL_FILENAME))
    os.replace(tmp, DATA_DIR)


def download_data():
    """The stand-in's download: the offline demo corpus (trnsweep's model.data.demo_text), built beside it."""
    import tempfile

    from model.data.demo_text import build_demo_corpus

    if os.path.isdir(DATA_DIR):
        return
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        fill_data(build_demo_corpus(os.path.join(tmp, "demo")))


if __name__ == "__main__":
    download_data()
    train_tokenizer()
    print(f"data in {DATA_DIR}, tokenizer ready in {TOKENIZER_DIR}")
