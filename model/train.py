"""Train one GPT under the competition's charged clock and report val_bpb.

    python -m model.train --config FILE_OR_JSON --budget-s N [--json] [--out-dir DIR]
    torchrun --nproc_per_node=K -m model.train ...

The charged clock runs during training steps only: start-up is free up to an allowance (what it spends past
that is charged), the first few steps are excluded, intermediate evaluations pause it, and the loop stops
before the next step would cross the budget. After the final evaluation, CORE runs when `core_bundle` is set
(not charged; its seconds are recorded apart). With --json, stdout carries JSON lines (`start`, `step`,
`eval`, then `result`, always last); human-readable logs go to stderr.

`tokens_per_second` is the charged steps' tokens over those steps' seconds (the excluded steps and any
start-up charged past the allowance are in neither); `eval_tokens_per_second` the val_bpb evaluations'
scored positions over their seconds (CORE apart).

Long file: the loop, its clock and the result record are one story (the record's fields are made where they
are measured); splitting it would scatter the charged-time rules.

Exit codes: 0 when a result with status ok, stopped or diverged was printed; 1 when the run failed
(a `failed` result is printed where possible); 2 for a bad configuration or bad data, with one line.
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports: their time is start-up too

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from model import collective, faults  # noqa: E402
from model import device as devices  # noqa: E402
from model.config import ConfigError, GPTConfig, TrainConfig, load_config_arg, parse_config, resolve_batch  # noqa: E402
from model.data import BatchLoader, DataError, check_scoring, load_dataset  # noqa: E402
from model.democore import resolve_bundle  # noqa: E402
from model.evaluate import (  # noqa: E402
    eval_batch_rows,
    evaluate_bpb,
    evaluate_core,
    final_val_bpb,
    load_bundle,
    pruning_autocast,
    pruning_batches,
)
from model.gpt import GPT  # noqa: E402
from model.optim import Optimizers  # noqa: E402

STOP_NONE, STOP_BUDGET, STOP_SIGNAL, STOP_DIVERGED = 0, 1, 2, 3
# The CORE fields of a record where CORE did not run (no bundle, or no finished training to score).
NO_CORE: dict[str, Any] = {"core": None, "core_tasks": {}, "core_seconds": 0.0, "core_complete": False,
                           "core_examples": 0}


class Events:
    """Writes JSON lines to stdout (rank 0 only) and human lines to stderr."""

    def __init__(self, enabled: bool, json_mode: bool) -> None:
        self.enabled = enabled
        self.json_mode = json_mode

    def emit(self, event: str, **fields: Any) -> None:
        if self.enabled and self.json_mode:
            print(json.dumps({"event": event, **fields}, default=_jsonable), flush=True)

    def log(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stderr, flush=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


@dataclass
class ChargedClock:
    """Charged seconds as the competition counts them; see the module docstring."""

    budget_s: float
    allowance_s: float
    excluded_steps: int
    max_steps: int = 0
    startup_s: float = 0.0
    charged_s: float = 0.0
    last_step_s: float = 0.0
    steps_seen: int = 0
    excluded_s: float = 0.0  # training steps that were not charged, part of start-up
    step_times: list[float] = field(default_factory=list)  # the charged steps' own seconds, one per step

    def start(self, startup_s: float) -> None:
        self.startup_s = startup_s
        self.charged_s = max(0.0, startup_s - self.allowance_s)

    def add_step(self, seconds: float) -> None:
        """Record one step; excluded steps count as start-up, and may eat into the allowance."""
        self.steps_seen += 1
        if self.steps_seen <= self.excluded_steps:
            self.add_startup(seconds)
            self.excluded_s += seconds
            return
        self.charged_s += seconds
        self.last_step_s = seconds
        self.step_times.append(seconds)

    def add_startup(self, seconds: float) -> None:
        """Start-up time after the clock started (an excluded step, a failed kernel compile): past the allowance
        it is charged."""
        before = max(0.0, self.startup_s - self.allowance_s)
        self.startup_s += seconds
        self.charged_s += max(0.0, self.startup_s - self.allowance_s) - before

    @property
    def steps_charged(self) -> int:
        return max(0, self.steps_seen - self.excluded_steps)

    @property
    def step_charged_s(self) -> float:
        """The charged seconds the charged steps took: charged_s less the start-up charged past the allowance
        (on several ranks both are the slowest rank's, as _agree_on_clock leaves them)."""
        return self.charged_s - max(0.0, self.startup_s - self.allowance_s)

    @property
    def progress(self) -> float:
        if self.max_steps:
            return min(self.steps_seen / self.max_steps, 1.0)
        return min(self.charged_s / self.budget_s, 1.0)

    def should_stop(self) -> bool:
        """Stop before the next step would cross the budget (judged by the last step's time)."""
        if self.max_steps and self.steps_seen >= self.max_steps:
            return True
        return self.steps_seen > self.excluded_steps and self.charged_s + self.last_step_s > self.budget_s


# Where a charged step's seconds go, summed over the charged steps (the record's `<part>_seconds`): host time
# between two readings of the clock that is already read each step, so no synchronisation is added. On the CPU
# each part is its compute; on an asynchronous device (CUDA, Neuron) forward, backward and optimizer are the
# host's dispatch, and `sync` the wait for the device at the step's end (rt.synchronize, as before).
STEP_PARTS = ("data", "forward", "backward", "all_reduce", "optimizer", "sync")


class StepTimer:
    """``lap(part)`` adds the seconds since the last lap (or the timer's start) to ``parts[part]``."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(STEP_PARTS, 0.0)
        self.last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] += now - self.last
        self.last = now


@dataclass
class RunState:
    step: int = 0
    tokens: int = 0
    eval_seconds: float = 0.0
    eval_tokens: int = 0  # positions of the rows scored (padding rows left out), every evaluation but CORE
    last_loss: float = float("nan")
    status: str = "ok"
    reason: str = ""
    curve: list[dict[str, float]] = field(default_factory=list)
    step_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))


_stop_requested = False


def _on_sigterm(signum, frame) -> None:
    global _stop_requested
    _stop_requested = True


def _all_reduce_grads(params: list[torch.nn.Parameter], world_size: int) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _agree_on_stop(code: int, rt: devices.Runtime) -> int:
    if rt.world_size == 1:
        return code
    return max(row[0] for row in collective.gather_ints([code], rt.device))


def _same_on_all_ranks(value: int, rt: devices.Runtime) -> bool:
    """Whether an integer (a batch digest, 62 bits) is the same on every rank: the data's one collective."""
    if rt.world_size == 1:
        return True
    return all(row == [value] for row in collective.gather_ints([value], rt.device))


def _agree_on_clock(code: int, clock: ChargedClock, rt: devices.Runtime) -> int:
    """Make every rank adopt the slowest rank's charged seconds and the strongest stop request.

    Ranks time their own steps; if each kept its own clock they would reach eval points and the budget
    at different steps and deadlock in mismatched collectives. One small all-reduce per step avoids it.
    """
    if rt.world_size == 1:
        return code
    # Exact float64 MAX without float64 on the device (model.collective).
    code_f, clock.charged_s, clock.startup_s = collective.max_floats([float(code), clock.charged_s, clock.startup_s],
                                                                     rt.device)
    return int(code_f)


def _recompile(model: GPT, compile_: bool, kind: str) -> torch.nn.Module:
    """The module the steps call: the model, compiled for the device when `compile` is on (afresh after a change
    of ops)."""
    if not compile_:
        return model
    return torch.compile(model, backend="neuron" if kind == "neuron" else "inductor")


def _compile_optimizer(opt: Optimizers, run: Any, kind: str, events: Events) -> dict[str, Any]:
    """Compile the optimiser's updates before the clock starts, where the backend allows it: inductor on the CPU
    and CUDA (compile_optimizer); on Neuron only with `compile` (docs/neuron.md says why). A failed compile
    leaves the eager updates, recorded, never the trial's end."""
    wanted = run.compile if kind == "neuron" else (run.compile or run.compile_optimizer)
    if not wanted:
        return {"optimizer_compiled": False}
    t0 = time.perf_counter()
    try:
        opt.compile("neuron" if kind == "neuron" else "inductor")
    except Exception as e:
        events.log(f"optimizer compile failed, its eager updates run instead: {e!r}")
        return {"optimizer_compiled": False, "optimizer_compile_error": f"{type(e).__name__}: {_first_line(e)}"}
    seconds = time.perf_counter() - t0
    events.log(f"optimizer compiled in {seconds:.1f}s (start-up)")
    return {"optimizer_compiled": True, "optimizer_compile_seconds": seconds}


def _compile_loss(model: GPT, opt: Optimizers, run: Any, rt: devices.Runtime, seq_len: int,
                  events: Events) -> dict[str, Any]:
    """Compile training's cross-entropy before the clock starts (compile_loss; on Neuron only with `compile`,
    whose compiled model holds it already): one forward and backward of a batch of zeros at the training shape
    compiles both graphs, and its gradients are dropped. A failed compile leaves the eager chain, recorded."""
    if run.compile or not run.compile_loss or rt.kind == "neuron" or not model.compile_loss():
        return {"loss_compiled": False}
    t0 = time.perf_counter()
    x = torch.zeros(run.batch_size, seq_len, dtype=torch.long, device=rt.device)
    try:
        with rt.autocast():
            loss = model(x, x)
        loss.backward()
    except Exception as e:
        model.ops = replace(model.ops, compiled_loss=False)
        events.log(f"loss compile failed, the eager chain runs instead: {e!r}")
        return {"loss_compiled": False, "loss_compile_error": f"{type(e).__name__}: {_first_line(e)}"}
    finally:
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    events.log(f"loss compiled in {seconds:.1f}s (start-up)")
    return {"loss_compiled": True, "loss_compile_seconds": seconds}


def train(cfg: TrainConfig, rt: devices.Runtime, events: Events, out_dir: Path | None,
          fault: faults.Fault | None = None, *, final_eval: bool = True, eval_batch_size: int = 0) -> dict[str, Any]:
    """One budgeted run; `fault` is a test-only injected fault (model.faults), None in real runs.
    `final_eval` False: no final evaluation (a submission-clean run; its score comes from the kit's scorer);
    `eval_batch_size` the kit dialect's evaluation batch (0: batch_size)."""
    run = cfg.run
    if run.num_threads > 0:
        torch.set_num_threads(run.num_threads)
    torch.manual_seed(run.seed)

    # A given tokenizer file fixes the vocabulary, and so does the kit's tokenizer (its TOKENIZER_VOCAB_SIZE and
    # BOS id, whatever the study trained on); otherwise one of vocab_size is trained.
    vocab_size = None if run.tokenizer or _is_kit_source(run.data) else cfg.model.vocab_size
    ds = load_dataset(run.data or None, vocab_size, cache_dir=run.cache_dir,
                      tokenizer=run.tokenizer or None, val_shard=run.val_shard or None)
    cfg.model.vocab_size = ds.vocab_size
    core_tasks = None
    if run.core_bundle:  # read before training: a broken bundle must fail fast, not after the budget
        core_tasks = load_bundle(resolve_bundle(run.core_bundle, run.cache_dir))
    max_loss = run.max_loss or 2.0 * math.log(ds.vocab_size)
    model = GPT(cfg.model).to(rt.device)
    model.train()
    n_params = model.num_params()
    opt = Optimizers(model.param_groups(), cfg.model.model_dim, cfg.optim, rt.device)
    step_model = _recompile(model, run.compile, rt.kind)
    compile_record = {**_compile_optimizer(opt, run, rt.kind, events),
                      **_compile_loss(model, opt, run, rt, cfg.model.seq_len, events)}

    B, T = run.batch_size, cfg.model.seq_len
    check_scoring(ds, run.eval_seq_len)  # a final evaluation the data cannot give fails now, not after the budget
    same = functools.partial(_same_on_all_ranks, rt=rt)  # the kit's loader may not split ranks (model.data.kit)
    loader = BatchLoader(ds, batch_size=B, seq_len=T, rank=rt.rank, world_size=rt.world_size, seed=run.seed,
                         same_on_all_ranks=same)
    # No validation data is read unless an intermediate evaluation is scheduled (a submission reads none).
    eval_batches = (pruning_batches(ds, B, T, run.eval_tokens, run.final_eval_tokens, rt.rank, rt.world_size, same)
                    if run.eval_fractions or run.eval_at_start else [])
    kit_dialect = getattr(ds, "dialect", None) if ds.is_kit else None
    tokens_per_step = B * T * run.grad_accum * rt.world_size
    clock = ChargedClock(run.budget_s, run.startup_allowance_s, run.excluded_steps, run.max_steps)
    state = RunState()
    pending_evals = sorted(set(run.eval_fractions) - {1.0})

    eval_rows = eval_batch_rows(cfg.model, T, B, rt.device)
    eval_autocast = pruning_autocast(rt.device, rt.autocast_dtype)

    def intermediate_eval() -> None:
        t0 = time.perf_counter()
        res = evaluate_bpb(model, eval_batches, ds.token_bytes, rt.device, eval_autocast, eval_rows)
        state.eval_seconds += time.perf_counter() - t0
        state.eval_tokens += res.rows * T
        point = {"step": state.step, "charged_s": round(clock.charged_s, 4),
                 "progress": round(clock.progress, 4), "val_bpb": res.val_bpb, "val_loss": res.val_loss}
        state.curve.append(point)
        events.emit("eval", **point)
        events.log(f"eval step {state.step} charged {clock.charged_s:.1f}s val_bpb {res.val_bpb:.4f}")

    events.emit("start", device=rt.kind, params=n_params, world_size=rt.world_size, config=cfg.to_dict(),
                data=ds.fingerprint, startup_seconds=time.perf_counter() - _PROCESS_START)
    events.log(f"training {n_params:,} params on {rt.kind} x{rt.world_size}, budget {run.budget_s}s")
    if run.eval_at_start:
        intermediate_eval()
    clock.start(time.perf_counter() - _PROCESS_START)

    while True:
        stop = STOP_NONE
        if _stop_requested:
            stop = STOP_SIGNAL
        elif clock.should_stop():
            stop = STOP_BUDGET
        stop = _agree_on_clock(stop, clock, rt)
        while stop != STOP_SIGNAL and pending_evals and clock.progress >= pending_evals[0]:
            pending_evals.pop(0)
            intermediate_eval()
        if stop != STOP_NONE:
            if stop == STOP_SIGNAL:
                state.status, state.reason = "stopped", "stopped by SIGTERM"
            break

        t0 = time.perf_counter()
        lrm = opt.set_progress(clock.progress)
        lap = StepTimer()
        try:
            for _ in range(run.grad_accum):
                x, y = next(loader)
                x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
                lap("data")
                with rt.autocast():
                    loss = step_model(x, y)
                if fault is not None and state.step == fault.step:
                    loss = faults.inject(fault.kind, loss)
                lap("forward")
                (loss / run.grad_accum).backward()
                lap("backward")
        except Exception as e:  # the NKI kernels compile at the first step: a failure there costs them, not the trial
            if state.step > 0 or model.kernel_choice.impl != "nki":
                raise
            events.log(f"NKI kernels failed at the first step; going on with the PyTorch ops: {e!r}")
            model.fall_back_to_torch_ops(e)
            opt.zero_grad()
            torch._dynamo.reset()  # no graph traced with the NKI ops survives
            step_model = _recompile(model, run.compile, rt.kind)
            clock.add_startup(time.perf_counter() - t0)  # not a step: start-up, as any compile
            continue
        if rt.world_size > 1:
            _all_reduce_grads(list(model.parameters()), rt.world_size)
        lap("all_reduce")
        opt.step()
        opt.zero_grad()
        lap("optimizer")
        rt.synchronize()
        lap("sync")
        if ds.is_kit:
            ds.step_boundary(state.step)  # the kit's official clock: its step log, after the step's synchronise
        clock.add_step(time.perf_counter() - t0)
        if clock.steps_seen > clock.excluded_steps:  # the charged steps' time, part by part
            for part, seconds in lap.parts.items():
                state.step_parts[part] += seconds
        state.step += 1
        state.tokens += tokens_per_step

        at_log = state.step % run.log_every == 0 or state.step <= 1
        if at_log or (fault is not None and fault.kind == "diverge"):
            state.last_loss = loss.detach().float().item()
            diverged = not math.isfinite(state.last_loss) or state.last_loss > max_loss
            if _agree_on_stop(STOP_DIVERGED if diverged else STOP_NONE, rt) == STOP_DIVERGED:
                state.status = "diverged"
                state.reason = (f"training loss {state.last_loss:.4g} at step {state.step}"
                                f" (bound {max_loss:.4g})")
                events.log(f"diverged: {state.reason}")
                break
            if at_log:
                tps = tokens_per_step / clock.last_step_s if clock.last_step_s else 0.0
                events.emit("step", step=state.step, charged_s=round(clock.charged_s, 4),
                            progress=round(clock.progress, 4), train_loss=state.last_loss,
                            tokens_per_second=tps, lrm=lrm, step_seconds=clock.last_step_s,
                            epoch=_epoch(loader))

    train_seconds = clock.charged_s
    result: dict[str, Any] = {
        "status": state.status, "val_bpb": None, "val_loss": None, "val_tokens": 0, "val_bytes": 0,
        "val_rows": 0, "val_population_rows": 0, "val_seq_len": None, "val_bpb_stderr": None,
        "train_seconds": train_seconds, "startup_seconds": clock.startup_s,
        "steps": state.step, "tokens": state.tokens,
        # Throughput of the charged steps: their tokens over their seconds. The excluded steps' tokens are in
        # `tokens` but their seconds are start-up, and start-up charged past the allowance trains nothing.
        "tokens_per_second": _rate(clock.steps_charged * tokens_per_step, clock.step_charged_s),
        "params": n_params, "flops_per_token": model.flops_per_token(), "device": rt.kind,
        "world_size": rt.world_size, "budget_s": run.budget_s, "over_budget": train_seconds > run.budget_s,
        "train_loss": state.last_loss, "data": ds.fingerprint, "kit_dialect": kit_dialect, "curve": state.curve,
        "step_seconds_median": statistics.median(clock.step_times) if clock.step_times else 0.0,
        "step_seconds_max": max(clock.step_times, default=0.0), "step_seconds_sum": sum(clock.step_times),
        "excluded_steps": run.excluded_steps,
        "excluded_seconds": clock.excluded_s,
        **{f"{part}_seconds": seconds for part, seconds in state.step_parts.items()},
        **compile_record,
        **model.kernel_choice.record(),
        **NO_CORE,
    }
    if state.status == "ok":
        # The checkpoint first: the competition's clock runs until it is saved; its evaluation comes after.
        t0 = time.perf_counter()
        if out_dir is not None and run.save_checkpoint and rt.is_master:
            save_checkpoint(model, out_dir / "final.pt", ds.tokenizer)
            result["checkpoint"] = str(out_dir / "final.pt")
        result["checkpoint_seconds"] = time.perf_counter() - t0
        if final_eval:
            t0 = time.perf_counter()
            if kit_dialect == "kit":
                result.update(_kit_final_score(model, ds, cfg, rt, eval_batch_size or run.batch_size))
            else:
                result.update(final_val_bpb(model, ds, run.batch_size, T, run.final_eval_tokens, run.final_eval_rows,
                                            run.eval_seq_len, rt.device, rt.autocast(), rt.rank, rt.world_size,
                                            same))
            state.eval_seconds += time.perf_counter() - t0
            # A kit that does not say its length scored val_tokens that we know of, at a length we do not.
            length = result["val_seq_len"]
            state.eval_tokens += result["val_rows"] * length if length else result["val_tokens"]
        if core_tasks is not None:
            result.update(_run_core(model, ds.tokenizer, core_tasks, cfg, rt, events, fault))
    # Evaluation's throughput beside training's: every val_bpb evaluation (intermediate and final), not CORE.
    result.update(eval_seconds=state.eval_seconds, eval_tokens=state.eval_tokens,
                  eval_tokens_per_second=_rate(state.eval_tokens, state.eval_seconds))
    model_flops = model.flops_per_token() * result["tokens_per_second"]
    peak = rt.peak_flops()
    result["model_flops_per_second"] = model_flops
    result["mfu"] = model_flops / peak if peak else None
    if state.reason:
        result["reason"] = state.reason
    if run.compile:
        from torch._dynamo.utils import counters

        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["compiled_graphs"] = counters["stats"]["unique_graphs"]
    result["peak_memory_bytes"] = rt.peak_memory_bytes()
    result["config"] = cfg.to_dict()
    return result


def _is_kit_source(data: str) -> bool:
    return data == "kit" or data.startswith("kit:")


def _epoch(loader: Any) -> int | None:
    """The kit's epoch counter from its loader's last state ({"epoch": n}), when it gives one."""
    state = getattr(loader, "state", None)
    epoch = state.get("epoch") if isinstance(state, dict) else None
    return int(epoch) if isinstance(epoch, int) else None


def _kit_final_score(model: GPT, ds: Any, cfg: TrainConfig, rt: devices.Runtime, batch_size: int) -> dict[str, Any]:
    """The kit dialect's own evaluate_bpb dict (`kit_eval`) on public_val at eval_seq_len (0: seq_len) over
    final_eval_tokens, and its causality_check (`causality`); the record's val_* fields from that dict.

    Scored as `prepare.py eval-public` scores the checkpoint, in one process: rank 0 alone with the kit's
    get_dist_info answering a single process (KitData.one_process), the other ranks waiting, so the figure is
    the official scorer's whatever the number of ranks. A kit without get_dist_info is called on every rank."""
    run = cfg.run
    T = run.eval_seq_len or cfg.model.seq_len
    alone = rt.world_size > 1 and ds.scores_alone
    if alone and not rt.is_master:
        _agree_on_stop(STOP_NONE, rt)  # wait for rank 0's score
        return {"val_rows": 0, "val_seq_len": T, "kit_eval_ranks": 1}
    with ds.one_process() if alone else contextlib.nullcontext():
        causality = ds.causality(model, batch_size, T, rt.device)
        got = ds.score(model, batch_size, T, run.final_eval_tokens, rt.device)
    if alone:
        _agree_on_stop(STOP_NONE, rt)
    tokens, nats = int(got.get("num_tokens", 0)), float(got.get("total_nats", float("nan")))
    return {"val_bpb": float(got["val_bpb"]), "val_loss": nats / tokens if tokens else None, "val_tokens": tokens,
            "val_bytes": int(got.get("num_bytes", 0)), "val_rows": tokens // T if T else 0,
            "val_population_rows": tokens // T if T else 0, "val_seq_len": T, "val_bpb_stderr": 0.0,
            "kit_eval": got, "causality": causality, "kit_eval_ranks": 1 if alone else rt.world_size}


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def _run_core(model: GPT, tokenizer: Any, tasks: list, cfg: TrainConfig, rt: devices.Runtime,
              events: Events, fault: faults.Fault | None = None) -> dict[str, Any]:
    """CORE's record fields; a failure here costs the CORE figure (core_error says why), never the val_bpb."""
    run = cfg.run
    try:
        if fault is not None and fault.kind == "core_crash":
            raise RuntimeError("injected fault in CORE")
        core = evaluate_core(model, tokenizer, tasks, seq_len=cfg.model.seq_len, batch_size=run.batch_size,
                             buckets=run.core_buckets, device=rt.device, autocast=rt.autocast(),
                             max_seconds=run.core_max_seconds, max_examples=run.core_max_examples, rank=rt.rank,
                             world_size=rt.world_size)
    except (RuntimeError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError
        events.log(f"CORE failed: {e!r}")
        return {**NO_CORE, "core_error": f"{type(e).__name__}: {_first_line(e)}"}
    events.log(f"CORE {core.core} over {core.examples} examples in {core.seconds:.1f}s"
               + ("" if core.complete else " (time limit: incomplete)"))
    return core.record()


def save_checkpoint(model: GPT, path: Path, tokenizer: Any = None) -> None:
    """Write atomically: a reader never sees half a checkpoint.

    The tokenizer, when it can be saved, goes next to it as tokenizer.json (where model.inference looks).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    ours = tokenizer.as_tokenizer() if hasattr(tokenizer, "as_tokenizer") else tokenizer  # the kit's wraps ours
    if ours is not None:
        ours.save(path.parent / "tokenizer.json")
    tmp = path.with_suffix(".tmp")
    torch.save({"model_config": model.config.to_dict(), "state_dict": model.state_dict()}, tmp)
    tmp.replace(path)


class EvalGPT(GPT):
    """The GPT a scorer receives: per-token losses, shaped as the targets, under either keyword teams' models
    take (`reduction="none"`, autoresearch's; `loss_reduction="none"`); any context length (the rotary tables
    grow to the rows it is given)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean",
                loss_reduction: str | None = None) -> torch.Tensor:
        reduction = loss_reduction or reduction
        out = super().forward(idx, targets, reduction)
        return out.view(targets.shape) if targets is not None and reduction == "none" else out


def load_for_eval(checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu") -> GPT:
    """A plain causal GPT in eval mode, as the competition asks of a submission (EvalGPT: both loss keywords)."""
    ckpt = torch.load(checkpoint_path, map_location=device, weights_only=True)
    model = EvalGPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def _summary_block(result: dict[str, Any]) -> str:
    """The competition train.py's closing block, for people reading a plain run."""
    r = result
    startup, charged = r.get("startup_seconds", 0.0), r.get("train_seconds", 0.0)
    allowance = r.get("config", {}).get("startup_allowance_s", 0.0)
    rows = [
        ("val_bpb", r.get("val_bpb")), ("status", r["status"]),
        ("training_seconds", round(charged, 2)),
        ("startup_seconds", round(startup, 2)),
        # The competition's names: start-up the allowance covers, and the clock with start-up past it (which
        # train_seconds already holds).
        ("startup_allowance_est", round(min(startup, allowance), 2)), ("charged_seconds_est", round(charged, 2)),
        ("over_budget", r.get("over_budget")), ("num_steps", r.get("steps")),
        ("total_tokens_M", round(r.get("tokens", 0) / 1e6, 3)), ("world_size", r["world_size"]),
        ("seq_len", r["config"]["seq_len"]), ("num_params_M", round(r.get("params", 0) / 1e6, 3)),
    ]
    return "---\n" + "\n".join(f"{k}: {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="{}", help="inline JSON, or a .json/.toml file")
    parser.add_argument("--budget-s", type=float, default=None, help="charged training seconds")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout")
    parser.add_argument("--out-dir", type=Path, default=None, help="where final.pt goes")
    parser.add_argument("--competition", action="store_true",
                        help="the competition's output: the summary block last; the result record goes to "
                             "OUT_DIR/result.json instead of a JSON line")
    args = parser.parse_args(argv)
    try:
        cfg = parse_config(load_config_arg(args.config), budget_s=args.budget_s)
        fault = faults.fault_from_env(cfg.run.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rt = devices.setup(cfg.run.device)
    except (RuntimeError, ValueError) as e:
        print(f"error: device {cfg.run.device}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        resolve_batch(cfg, rt.world_size)
    except ConfigError as e:
        devices.teardown()
        print(f"error: {e}", file=sys.stderr)
        return 2
    events = Events(rt.is_master, args.json)
    code = 0
    try:
        result = train(cfg, rt, events, args.out_dir, fault)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError) as e:
        result, code = _failed(cfg, rt, f"out of memory: {_first_line(e) or 'MemoryError'}"), 1
    except Exception as e:  # the sweep needs a result line and a reason, whatever broke
        result, code = _failed(cfg, rt, f"{type(e).__name__}: {_first_line(e)}"), 1
        # Every rank says why it stopped: a rank other than 0 prints no record, and its error is often the cause.
        print(f"rank {rt.rank}: {e!r}", file=sys.stderr, flush=True)
    finally:
        devices.teardown()
    if rt.is_master:
        if not args.json:
            print(_summary_block(result), flush=True)
        # The result record is the last stdout line, with or without --json; the competition's format (an
        # exported train.py) ends on the summary block instead.
        line = json.dumps({"event": "result", **result}, default=_jsonable)
        if not args.competition:
            print(line, flush=True)
        elif args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / "result.json").write_text(line + "\n")
    return code


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else ""


def _failed(cfg: TrainConfig, rt: devices.Runtime, reason: str) -> dict[str, Any]:
    return {"status": "failed", "reason": reason, "val_bpb": None, "device": rt.kind,
            "world_size": rt.world_size, **NO_CORE, "config": cfg.to_dict()}


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the checkpoint renamed into place; skip a second of interpreter teardown
    # (unloading torch) that would otherwise be charged to the trial's slot.
    os._exit(exit_code)
