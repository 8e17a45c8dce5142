"""Exact agreement over ranks without float64 or int64 on the device (model.collective).

The multi-rank test runs real gloo process groups on the CPU and checks three things against what the
trainer did before (float64 / int64 all-reduces): the results are equal, bit for bit where the old
collective was exact (MAX, integers), and the only collective on the wire is a float32 SUM, which a
NeuronCore holds.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import collective

CLOCKS = [0.0, 1e-9, 0.1, 1 / 3, 299.99999999999994, 300.0, 12345.678901234567, math.pi * 1e5, -2.5]


def test_floats_split_into_float32_pieces_and_join_exactly():
    rng = random.Random(0)
    values = CLOCKS + [rng.uniform(0, 1e4) for _ in range(2000)] + [rng.uniform(-1e30, 1e30) for _ in range(200)]
    pieces = collective.split_floats(values)
    assert pieces.dtype == torch.float32 and pieces.shape == (len(values), 3)
    assert collective.join_floats(pieces) == values
    assert collective.join_floats(collective.split_floats([math.inf, -math.inf]))[0] == math.inf
    with pytest.raises(ValueError, match="beyond float32's range"):
        collective.split_floats([1e300])


def test_ints_split_into_exact_limbs():
    values = [0, 1, -1, 3, (1 << 62) - 1, -(1 << 62), 0x2F3C_91AB_77D0_1234 & ((1 << 62) - 1)]
    limbs = collective.split_ints(values)
    assert limbs.dtype == torch.float32 and float(limbs.max()) < 2**21
    assert collective.join_ints(limbs) == values
    with pytest.raises(ValueError, match="62-bit"):
        collective.split_ints([1 << 62])


def test_one_process_needs_no_collective():
    assert collective.max_floats([1.5, 2.0], torch.device("cpu")) == [1.5, 2.0]
    assert collective.gather_ints([7], torch.device("cpu")) == [[7]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    rng = random.Random(rank)
    clock = [float(rank % 3), rng.uniform(0, 300), rng.uniform(0, 30)]  # (code, charged_s, startup_s)
    totals = [rng.uniform(0, 1e6), float(rng.randrange(1 << 20)), float(rng.randrange(1 << 23)), 64.0,
              rng.uniform(0, 1e9), rng.uniform(0, 1e9), rng.uniform(0, 1e9)]
    digest = rng.getrandbits(62) if rank else 0x3FFF_FFFF_FFFF_FFFF
    # Before: float64 and int64 all-reduces.
    t = torch.tensor(clock, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    old_clock = t.tolist()
    t = torch.tensor(totals, dtype=torch.float64)
    dist.all_reduce(t)
    old_totals = t.tolist()
    t = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    old_same = t.tolist() == [digest, -digest]
    t = torch.tensor([rank % 3], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    old_stop = int(t.item())
    # Now: every collective must be a float32 SUM.
    seen = []
    real = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, **kw):
        seen.append((tensor.dtype, op))
        return real(tensor, op=op, **kw)

    dist.all_reduce = spy
    try:
        new_clock = collective.max_floats(clock, cpu)
        new_totals = collective.sum_floats(totals, cpu)
        new_same = all(row == [digest] for row in collective.gather_ints([digest], cpu))
        new_stop = max(row[0] for row in collective.gather_ints([rank % 3], cpu))
        everyone = collective.gather_floats(totals, cpu)
    finally:
        dist.all_reduce = real
    result = {"old": (old_clock, old_totals, old_same, old_stop), "new": (new_clock, new_totals, new_same, new_stop),
                     "fsum": [math.fsum(col) for col in zip(*everyone, strict=True)],
                     "ops": sorted([str(d), str(o)] for d, o in {(d, o) for d, o in seen})}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_ranks_agree_exactly_as_the_float64_collectives_did(tmp_path):
    world = 2
    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    results = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}
    for rank in range(world):
        old_clock, old_totals, old_same, old_stop = results[rank]["old"]
        new_clock, new_totals, new_same, new_stop = results[rank]["new"]
        assert new_clock == old_clock and new_stop == old_stop  # MAX: bit for bit
        assert new_same is False and old_same is False  # rank 0's digest differs: both see it
        assert new_totals == results[rank]["fsum"]  # the correctly rounded sum, the same on every rank
        assert new_totals == pytest.approx(old_totals, rel=1e-15, abs=0)
        assert results[rank]["ops"] == [["torch.float32", str(dist.ReduceOp.SUM)]]
    assert results[0]["new"][1] == results[1]["new"][1]
