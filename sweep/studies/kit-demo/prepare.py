"""A stand-in for the competition kit's prepare.py, in the kit's own dialect, on trnsweep's offline demo corpus.

The organisers' kit is not public. What its prepare.py offers is known from teams' public code built on it
(their copies of the baseline train.py, a team's own stand-in, their host configurations and logs); this
file is written afresh to those facts, for trnsweep's tests and its kit-dialect demo (sweep/studies/kit-demo/).
It is not the kit and copies nothing from it or from any team.

From teams' public code (the kit's names and signatures, kept exactly):
- constants TRAIN_TIME_BUDGET_SECONDS = 1800, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = 900,
  TRAIN_STARTUP_STEPS_EXCLUDED = 5 (the later release; an early one had 2), EVAL_TIMEOUT_SECONDS = 1200,
  TOKENIZER_VOCAB_SIZE = 8192. The kit has no MAX_SEQ_LEN, EVAL_TOKENS or TIME_BUDGET: training scripts
  keep their own clock and context, and the evaluation's context and token count are arguments;
- ensure_tokenizer(build_if_missing=False) -> a tokenizer with get_bos_token_id() (8188: the first id after
  the 8188 merged tokens), get_vocab_size(), encode(docs, prepend=bos, num_threads=...) and `.enc` (a
  tiktoken encoding); get_token_bytes(device="cpu"): each token id's length in bytes;
- make_dataloader(tokenizer, B, T, split, device) yielding (inputs int32 (B, T), targets int64 (B, T),
  {"epoch": n}), already split by rank (rank r reads every world-th row group), splits "train" and
  "public_val";
- evaluate_bpb(model, tokenizer, B, T, device, split="public_val", max_tokens=N,
  timeout_seconds=EVAL_TIMEOUT_SECONDS) -> dict with val_bpb, total_nats, num_tokens, num_bytes,
  eval_seconds, eval_timeout, eval_over_timeout; causality_check(model, tokenizer, B, T, device) ->
  {"passed", "max_abs_diff"}; get_dist_info() -> (ddp, rank, local_rank, world_size); print0(*args);
  record_step_boundary(step), which a training script calls after each step's synchronise, for the
  outside runner that keeps the official clock from the file NEURON_COMPETITION_R1_STEP_LOG names;
- the environment: NEURON_COMPETITION_R1_CACHE_DIR (data and tokenizer), NEURON_COMPETITION_R1_TOKENIZER_PATH,
  NEURON_COMPETITION_R1_STEP_LOG;
- the command line `python prepare.py setup [--num-train-shards N] [--build-tokenizer-if-missing]` and
  `python prepare.py eval-public --train-py train.py --checkpoint out/final.pt`, which imports the
  script's load_for_eval(checkpoint_path, device), scores the checkpoint with evaluate_bpb on public_val
  and prints the dict as JSON (indent 2, sorted keys).

This stand-in's own choices (nothing public says how the kit does these; trnsweep configures what depends
on them rather than assuming them):
- eval-public's further flags --seq-len T (default 1024), --eval-tokens N (default 4 * 524288),
  --batch-size B (default 8) and --device (default cpu) are ours; the kit's names for them are not public;
- setup downloads nothing: it cuts trnsweep's demo corpus (model.data.demo_text; the standard library's
  docs) into train_0000N.parquet (at most 7 shards, the first --num-train-shards of them) and
  public_val_00000.parquet, ROW_GROUP_DOCS documents a row group so that ranks share even one shard, and
  trains the tokenizer with rustbpe (the kit ships one; --build-tokenizer-if-missing is accepted and
  building is what this stand-in's "unpacking" means). It is idempotent and locked against a parallel setup.
  The tokenizer is stored as JSON (tokenizer.json: the split pattern, the merged tokens in rank order, the
  special tokens), token_bytes.pt beside it; BOS is <|bos|>, then three reserved specials of 0 bytes;
- CACHE_DIR is NEURON_COMPETITION_R1_CACHE_DIR or else this file's folder (copy the file into a fresh
  folder to make a fresh kit), holding data/ and tokenizer/; NEURON_COMPETITION_R1_TOKENIZER_PATH names
  the tokenizer's folder (or its tokenizer.json);
- rows: each document gets BOS in front and a rank's documents form one token stream, cut into batches of
  B * T + 1 tokens whose last token starts the next batch, so each token is a target once; the train
  stream loops with the epoch counted up; evaluate_bpb reads the split once (at most max_tokens over all
  ranks: max_tokens // (B * T * world) batches a rank, at least one) and stops early, flagged, past
  timeout_seconds;
- the model is called as model(x, y, <keyword>="none") for per-token losses, trying each keyword of
  LOSS_REDUCTION_KEYWORDS in turn (teams' models take loss_reduction, autoresearch's reduction); tokens of
  0 bytes are left out of the nats and the bytes; num_tokens counts every target read;
- causality_check perturbs the tokens from a few cut points on and requires the per-token losses before each
  cut to stay within CAUSALITY_TOLERANCE;
- a step log line is "<step> <unix time>"; everything but eval-public's JSON goes to stderr.
It runs on the CPU: a ~32k-token evaluation of a small model takes seconds.
"""

import argparse
import base64
import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

# ---- the kit's constants --------------------------------------------------------------------------
TRAIN_TIME_BUDGET_SECONDS = 1800
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS = 900
TRAIN_STARTUP_STEPS_EXCLUDED = 5
EVAL_TIMEOUT_SECONDS = 1200
TOKENIZER_VOCAB_SIZE = 8192

# ---- this stand-in's own settings -------------------------------------------------------------------
SPECIAL_TOKENS = ["<|bos|>", "<|reserved_1|>", "<|reserved_2|>", "<|reserved_3|>"]
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
TOKENIZER_DOC_CHARS = 10_000  # documents are cut to this many characters for the tokenizer's training
ROW_GROUP_DOCS = 64
MAX_TRAIN_SHARDS = 7  # the demo corpus's 8 shards: 7 to train on, the last one public_val
SPLITS = ("train", "public_val")
LOSS_REDUCTION_KEYWORDS = ("loss_reduction", "reduction")
DEFAULT_EVAL_TOKENS = 4 * 524288
CAUSALITY_TOLERANCE = 1e-4
ENV_CACHE_DIR = "NEURON_COMPETITION_R1_CACHE_DIR"
ENV_TOKENIZER_PATH = "NEURON_COMPETITION_R1_TOKENIZER_PATH"
ENV_STEP_LOG = "NEURON_COMPETITION_R1_STEP_LOG"


def cache_dir():
    return os.environ.get(ENV_CACHE_DIR) or os.path.dirname(os.path.abspath(__file__))


def data_dir():
    return os.path.join(cache_dir(), "data")


def tokenizer_dir():
    path = os.environ.get(ENV_TOKENIZER_PATH)
    if path:
        return os.path.dirname(path) if path.endswith(".json") else path
    return os.path.join(cache_dir(), "tokenizer")


# ---- distributed ----------------------------------------------------------------------------------

def get_dist_info():
    """(ddp, rank, local_rank, world_size): the process group's when one is up, else torchrun's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return world > 1, dist.get_rank(), local_rank, world
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE")):
        world = int(os.environ["WORLD_SIZE"])
        return world > 1, int(os.environ["RANK"]), local_rank, world
    return False, 0, 0, 1


def print0(*args, **kwargs):
    if get_dist_info()[1] == 0:
        print(*args, **kwargs, flush=True)


def record_step_boundary(step):
    """Rank 0 appends "<step> <unix time>" to the step log the outside runner clocks the run by (when named)."""
    path = os.environ.get(ENV_STEP_LOG)
    if not path or get_dist_info()[1] != 0:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{int(step)} {time.time():.6f}\n")


# ---- data -----------------------------------------------------------------------------------------

def _write_shard(texts, path):
    tmp = path + ".partial"
    pq.write_table(pa.table({"text": texts}), tmp, row_group_size=ROW_GROUP_DOCS, compression="zstd")
    os.replace(tmp, path)


def _fill_data(num_train_shards):
    """data/train_0000N.parquet (the first num_train_shards) and data/public_val_00000.parquet, once each."""
    from model.data.demo_text import build_demo_corpus

    out = data_dir()
    wanted = [os.path.join(out, f"train_{i:05d}.parquet") for i in range(num_train_shards)]
    val = os.path.join(out, "public_val_00000.parquet")
    if all(os.path.exists(p) for p in [*wanted, val]):
        return
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        corpus = build_demo_corpus(os.path.join(tmp, "demo"))
        shards = sorted(n for n in os.listdir(corpus) if n.startswith("shard_") and n.endswith(".parquet"))
        for src, dst in [*zip(shards[:-1], wanted, strict=False), (shards[-1], val)]:
            if not os.path.exists(dst):
                _write_shard(pq.read_table(os.path.join(corpus, src)).column("text").to_pylist(), dst)


def _split_paths(split):
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: the kit's splits are {', '.join(SPLITS)}")
    prefix = "train_" if split == "train" else "public_val_"
    folder = data_dir()
    names = os.listdir(folder) if os.path.isdir(folder) else []
    paths = sorted(os.path.join(folder, n) for n in names if n.startswith(prefix) and n.endswith(".parquet"))
    if not paths:
        raise FileNotFoundError(f"no {split} shards in {folder}: run `python prepare.py setup` first")
    return paths


def _row_groups(split, rank, world):
    """This rank's (path, row group) pairs: every world-th of the split's row groups, from the rank-th."""
    groups = [(p, g) for p in _split_paths(split) for g in range(pq.ParquetFile(p).num_row_groups)]
    return groups[rank::world]


def _documents(split, rank, world, loop):
    """(texts of one row group, epoch), this rank's share, in file order; endless when loop."""
    groups = _row_groups(split, rank, world)
    epoch = 1
    while True:
        for path, g in groups:
            yield pq.ParquetFile(path).read_row_group(g, columns=["text"]).column("text").to_pylist(), epoch
        if not loop:
            return
        epoch += 1


def _batches(tokenizer, B, T, split, device, loop):
    _, rank, _, world = get_dist_info()
    bos = tokenizer.get_bos_token_id()
    need = B * T + 1
    stream, epoch = [], 1
    source = _documents(split, rank, world, loop)
    while True:
        while len(stream) < need:
            try:
                texts, epoch = next(source)
            except StopIteration:
                return
            for row in tokenizer.encode(texts, prepend=bos):
                stream.extend(row)
        chunk = torch.tensor(stream[:need], dtype=torch.int64)
        del stream[:need - 1]
        inputs = chunk[:-1].view(B, T).to(device=device, dtype=torch.int32)
        targets = chunk[1:].view(B, T).to(device=device)
        yield inputs, targets, {"epoch": epoch}


def make_dataloader(tokenizer, B, T, split, device):
    """Endless (inputs int32 (B, T), targets int64 (B, T), {"epoch": n}) from this rank's share of the split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: the kit's splits are {', '.join(SPLITS)}")
    return _batches(tokenizer, B, T, split, device, loop=True)


# ---- tokenizer ------------------------------------------------------------------------------------

class CompetitionTokenizer:
    """A tiktoken encoding with BOS and the kit's calls."""

    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = enc.encode_single_token(SPECIAL_TOKENS[0])

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode(self, docs, prepend=None, num_threads=8):
        """Token ids of a text, or a list of them for a list of texts; `prepend` (a token id) goes in front."""
        if isinstance(docs, str):
            rows = [self.enc.encode_ordinary(docs)]
        elif isinstance(docs, list):
            rows = self.enc.encode_ordinary_batch(docs, num_threads=num_threads)
        else:
            raise TypeError(f"cannot encode a {type(docs).__name__}: give a str or a list of str")
        if prepend is not None:
            rows = [[prepend, *r] for r in rows]
        return rows[0] if isinstance(docs, str) else rows

    def decode(self, ids):
        return self.enc.decode(ids)


def _train_texts():
    for path in _split_paths("train"):
        for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
            yield text[:TOKENIZER_DOC_CHARS]


def _build_tokenizer():
    """tokenizer.json and token_bytes.pt in tokenizer_dir(), trained on the training shards (kept when present)."""
    import rustbpe
    import tiktoken

    folder = tokenizer_dir()
    if all(os.path.exists(os.path.join(folder, n)) for n in ("tokenizer.json", "token_bytes.pt")):
        return
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(_train_texts(), TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranked = sorted(((bytes(tok), rank) for tok, rank in bpe.get_mergeable_ranks()), key=lambda item: item[1])
    if [rank for _, rank in ranked] != list(range(len(ranked))):
        raise RuntimeError("the trained tokenizer's ranks are not 0..n-1")
    ranks = dict(ranked)
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding(name="kit-standin", pat_str=bpe.get_pattern(), mergeable_ranks=ranks,
                            special_tokens=specials)
    lengths = [len(tok) for tok, _ in ranked] + [0] * len(SPECIAL_TOKENS)
    probe = "Hello world! Numbers: 123. Unicode: \u4f60\u597d"
    if enc.decode(enc.encode_ordinary(probe)) != probe:
        raise RuntimeError("the trained tokenizer does not round-trip text")
    os.makedirs(folder, exist_ok=True)
    payload = {"pattern": bpe.get_pattern(), "special_tokens": specials,
               "mergeable_ranks": [base64.b64encode(tok).decode("ascii") for tok, _ in ranked]}
    tmp = os.path.join(folder, "token_bytes.pt.partial")
    torch.save(torch.tensor(lengths, dtype=torch.int32), tmp)
    os.replace(tmp, os.path.join(folder, "token_bytes.pt"))
    tmp = os.path.join(folder, "tokenizer.json.partial")  # written last: its presence means "ready"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, os.path.join(folder, "tokenizer.json"))


def ensure_tokenizer(build_if_missing=False):
    """The kit's tokenizer; a missing one is built when build_if_missing, else a FileNotFoundError says why."""
    import tiktoken

    path = os.path.join(tokenizer_dir(), "tokenizer.json")
    if not os.path.exists(path):
        if not build_if_missing:
            raise FileNotFoundError(f"no tokenizer at {path}: run `python prepare.py setup` first")
        _build_tokenizer()
    with open(path, encoding="utf-8") as f:
        payload = json.load(f)
    ranks = {base64.b64decode(tok): rank for rank, tok in enumerate(payload["mergeable_ranks"])}
    enc = tiktoken.Encoding(name="kit-standin", pat_str=payload["pattern"], mergeable_ranks=ranks,
                            special_tokens=payload["special_tokens"])
    return CompetitionTokenizer(enc)


def get_token_bytes(device="cpu"):
    """Each token id's length in bytes (0 for the special tokens), an int32 tensor on `device`."""
    path = os.path.join(tokenizer_dir(), "token_bytes.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no token lengths at {path}: run `python prepare.py setup` first")
    return torch.load(path, map_location=device, weights_only=True)


# ---- the metric -----------------------------------------------------------------------------------

def _per_token_losses(model, x, y):
    """model(x, y, <keyword>="none") flattened, with the first keyword of LOSS_REDUCTION_KEYWORDS it takes."""
    for keyword in LOSS_REDUCTION_KEYWORDS:
        try:
            out = model(x, y, **{keyword: "none"})
        except TypeError as e:
            if keyword not in str(e):
                raise
            continue
        return out.reshape(-1).double()
    raise TypeError(f"the model takes none of the keywords {', '.join(LOSS_REDUCTION_KEYWORDS)} for per-token "
                    "losses")


@torch.no_grad()
def evaluate_bpb(model, tokenizer, B, T, device, split="public_val", max_tokens=DEFAULT_EVAL_TOKENS,
                 timeout_seconds=EVAL_TIMEOUT_SECONDS):
    """Bits per byte of `split` (see the module doc), each rank its share, the sums all-reduced."""
    t0 = time.time()
    ddp, _, _, world = get_dist_info()
    token_bytes = get_token_bytes(device="cpu").to(torch.int64)
    num_batches = max(1, int(max_tokens) // (B * T * world))
    nats, nbytes, ntokens = 0.0, 0, 0
    over = False
    for i, (x, y, _) in enumerate(_batches(tokenizer, B, T, split, device, loop=False)):
        if i >= num_batches:
            break
        loss = _per_token_losses(model, x, y).cpu()
        lengths = token_bytes[y.reshape(-1).cpu()]
        counted = lengths > 0
        nats += loss[counted].sum().item()
        nbytes += int(lengths.sum().item())
        ntokens += y.numel()
        if time.time() - t0 > timeout_seconds:
            over = True
            break
    sums = torch.tensor([nats, float(nbytes), float(ntokens), float(over)], dtype=torch.float64)
    if ddp and dist.is_initialized():
        sums = sums.to(device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    nats, nbytes, ntokens = sums[0].item(), int(sums[1].item()), int(sums[2].item())
    if nbytes == 0:
        raise RuntimeError(f"evaluate_bpb read no bytes of {split!r}: is the split empty for B={B}, T={T}?")
    seconds = time.time() - t0
    return {
        "val_bpb": nats / (math.log(2) * nbytes),
        "total_nats": nats,
        "num_tokens": ntokens,
        "num_bytes": nbytes,
        "eval_seconds": seconds,
        "eval_timeout": timeout_seconds,
        "eval_over_timeout": bool(sums[3].item() > 0) or seconds > timeout_seconds,
    }


@torch.no_grad()
def causality_check(model, tokenizer, B, T, device):
    """Whether perturbing tokens from a cut point on leaves every earlier per-token loss unchanged."""
    ddp, rank, _, _ = get_dist_info()
    x, y, _ = next(_batches(tokenizer, B, T, "public_val", device, loop=True))
    base = _per_token_losses(model, x, y).view(B, T)
    gen = torch.Generator().manual_seed(1234 + rank)
    vocab = tokenizer.get_vocab_size()
    worst = 0.0
    for cut in sorted({max(1, T // 4), max(1, T // 2), max(1, 3 * T // 4)}):
        x2, y2 = x.clone(), y.clone()
        x2[:, cut:] = torch.randint(0, vocab, x2[:, cut:].shape, generator=gen).to(x2)
        y2[:, cut:] = torch.randint(0, vocab, y2[:, cut:].shape, generator=gen).to(y2)
        moved = _per_token_losses(model, x2, y2).view(B, T)
        worst = max(worst, (moved[:, :cut] - base[:, :cut]).abs().max().item())
    if ddp and dist.is_initialized():
        t = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst = t.item()
    return {"passed": bool(worst <= CAUSALITY_TOLERANCE), "max_abs_diff": float(worst)}


# ---- the command line -----------------------------------------------------------------------------

@contextlib.contextmanager
def _setup_lock():
    import fcntl

    os.makedirs(cache_dir(), exist_ok=True)
    with open(os.path.join(cache_dir(), ".setup.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def setup(num_train_shards=MAX_TRAIN_SHARDS, build_tokenizer_if_missing=False):
    """The data and the tokenizer, built once (a parallel setup waits for this one)."""
    if not 1 <= num_train_shards <= MAX_TRAIN_SHARDS:
        raise ValueError(f"--num-train-shards must be 1..{MAX_TRAIN_SHARDS} (the demo corpus has no more), "
                         f"got {num_train_shards}")
    with _setup_lock():
        _fill_data(num_train_shards)
        _build_tokenizer()  # this stand-in's "shipped" tokenizer is built, with or without the flag
    tok = ensure_tokenizer()
    print(f"setup: data in {data_dir()}, tokenizer in {tokenizer_dir()} (vocab {tok.get_vocab_size()}, "
          f"bos {tok.get_bos_token_id()})", file=sys.stderr)


def _import_script(path):
    """train.py as a module registered in sys.modules before it runs (so its @dataclass resolves)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--train-py {path}: no such file")
    sys.modules.setdefault("prepare", sys.modules[__name__])
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "load_for_eval", None)):
        raise FileNotFoundError(f"{path} defines no load_for_eval(checkpoint_path, device)")
    return module


def eval_public(train_py, checkpoint, seq_len, eval_tokens, batch_size, device):
    script = _import_script(train_py)
    dev = torch.device(device)
    model = script.load_for_eval(checkpoint, dev)
    model.eval()
    result = evaluate_bpb(model, ensure_tokenizer(), batch_size, seq_len, dev, split="public_val",
                          max_tokens=eval_tokens, timeout_seconds=EVAL_TIMEOUT_SECONDS)
    print(json.dumps(result, indent=2, sort_keys=True), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Competition kit stand-in (trnsweep's, offline, CPU)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="build the data shards and the tokenizer (once)")
    p_setup.add_argument("--num-train-shards", type=int, default=MAX_TRAIN_SHARDS)
    p_setup.add_argument("--build-tokenizer-if-missing", action="store_true")
    p_eval = sub.add_parser("eval-public", help="score a checkpoint on public_val; prints JSON")
    p_eval.add_argument("--train-py", required=True)
    p_eval.add_argument("--checkpoint", required=True)
    p_eval.add_argument("--seq-len", type=int, default=1024)
    p_eval.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS)
    p_eval.add_argument("--batch-size", type=int, default=8)
    p_eval.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.command == "setup" and not 1 <= args.num_train_shards <= MAX_TRAIN_SHARDS:
        parser.error(f"--num-train-shards must be 1..{MAX_TRAIN_SHARDS} (the demo corpus has no more)")
    try:
        if args.command == "setup":
            setup(args.num_train_shards, args.build_tokenizer_if_missing)
        else:
            eval_public(args.train_py, args.checkpoint, args.seq_len, args.eval_tokens, args.batch_size,
                        args.device)
    except FileNotFoundError as e:
        print(f"prepare.py {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
