"""A byte-level stand-in of the competition kit's prepare.py, small enough to write into a test's folder.

The real kit is not public; FAKE_PREPARE follows what is known of it (model/data/kit.py's module doc): a
tiktoken tokenizer with four reserved specials, BOS = <|reserved_0|>, make_dataloader yielding
(x int32, y int64, state), get_token_bytes and evaluate_bpb. (tests/kit_standin is the fuller stand-in, in
autoresearch's prepare.py's shape, trained on the demo corpus.)
"""

from __future__ import annotations

import textwrap

FAKE_PREPARE = textwrap.dedent(
    '''
    """Stand-in for the competition kit's prepare.py: byte-level tokenizer, tiny corpus."""
    import tiktoken
    import torch

    TOKENIZER_VOCAB_SIZE = 260
    BOS_TOKEN = "<|reserved_0|>"
    EVAL_SEQ_LEN = 16
    DOCS = {
        "train": [f"training document number {i}: " + "lorem ipsum dolor " * (i % 7) for i in range(200)],
        "val": [f"validation text {i}, déjà vu " * (1 + i % 3) for i in range(50)],
    }


    class Tokenizer:
        def __init__(self, enc):
            self.enc = enc
            self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

        @classmethod
        def from_directory(cls, tokenizer_dir=None):
            ranks = {bytes([i]): i for i in range(256)}
            specials = {f"<|reserved_{i}|>": 256 + i for i in range(4)}
            return cls(tiktoken.Encoding(name="fake", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks,
                                         special_tokens=specials))

        def get_vocab_size(self):
            return self.enc.n_vocab

        def get_bos_token_id(self):
            return self.bos_token_id

        def encode(self, text, prepend=None):
            if isinstance(text, str):
                ids = self.enc.encode_ordinary(text)
                return [prepend, *ids] if prepend is not None else ids
            return [self.encode(t, prepend) for t in text]

        def decode(self, ids):
            return self.enc.decode(ids)


    def get_token_bytes(device="cpu"):
        return torch.tensor([1] * 256 + [0] * 4, dtype=torch.int32, device=device)


    def make_dataloader(tokenizer, B, T, split, device="cpu"):
        bos = tokenizer.get_bos_token_id()
        stream = [t for doc in DOCS[split] for t in tokenizer.encode(doc, prepend=bos)]
        pos, epoch = 0, 1
        while True:
            rows = []
            for _ in range(B):
                if pos + T + 1 > len(stream):
                    pos, epoch = 0, epoch + 1
                rows.append([bos] + stream[pos + 1 : pos + T + 1])
                pos += T
            t = torch.tensor(rows, dtype=torch.long, device=device)
            yield t[:, :-1].to(torch.int32), t[:, 1:].contiguous(), {"epoch": epoch, "pos": pos}


    @torch.no_grad()
    def evaluate_bpb(model, tokenizer, batch_size):
        token_bytes = get_token_bytes()
        loader = make_dataloader(tokenizer, batch_size, EVAL_SEQ_LEN, "val")
        nats, nbytes = 0.0, 0
        for _ in range(3):
            x, y, _ = next(loader)
            loss = model(x, y, reduction="none").view(-1)
            b = token_bytes[y.view(-1)]
            nats += (loss * (b > 0)).sum().item()
            nbytes += b.sum().item()
        return nats / (__import__("math").log(2) * nbytes)
    '''
)
