"""The study store under cluster load: N worker processes reporting every second to PostgreSQL.

Long file: one benchmark whose parts (the prefill, the worker process, the load driver and the report)
share their constants and are read together; split, each would need the others open beside it.

Each worker process runs trials the way a sweep's supervisors do: it reports an intermediate value
every second and asks the pruner (``trial.report`` + ``trial.should_prune``, timed together; the
answer is recorded, not acted on, so every configuration carries the same load), writes a
heartbeat every 10 s, tells the trial after ``STORAGE_LOAD_REPORTS`` reports and asks the next one
(``study.ask`` + the suggestions, timed; trial ends are spread out, as in a sweep under way). The
study is pre-filled with finished trials shaped like a real sweep's (params, value, intermediate
values, a result record as user attributes, liveness system attributes), by bulk SQL into
Optuna's own schema, checked with Optuna's reads.

Configurations: workers x pre-filled trials x proxy (direct to PostgreSQL through the sweep's worker
storage, or through the gRPC storage proxy the driver starts with ``SWEEP_STORAGE_PROXY=1``). One
JSON object per configuration with ``workers``, ``trials``, ``proxy``, ``report_prune_p50_ms``,
``report_prune_p99_ms``, ``ask_p99_ms``, ``db_connections`` (most connections to the database at
once, sampled from pg_stat_activity) and, for honesty, the duration, the machine's cores, the
client CPU per call, the errors, the cold-start read of the study and the pruner used.

How the figures are made, and what they are not:

- Workers start warm: the parent reads the study once (``cold_load_s``, what a fresh worker
  process pays once for its first pruning call; ``cache_mb``, the memory that cache takes in every
  worker process) and forks, so every worker holds the cache a long-lived Ray worker process
  holds. Measuring starts when every worker has reported twice (copy-on-write done).
- Pre-filled trials carry a compact record (status, train_seconds, steps, slot_seconds, spec_hash)
  by default: a sweep's full record (``STORAGE_LOAD_RECORD=full``, ~30 attributes with the config)
  makes the cache ~60 KB per trial, 585 MB per worker process at 10,000 trials, which 128 forked
  workers on a small machine cannot hold. The reporting path does not read other trials' records.
- All workers, PostgreSQL and the proxy share this machine's cores (``cpu_count``); on a cluster
  each worker runs on its own node. ``report_prune_cpu_p50_ms`` is the client's own CPU per call:
  when N x that approaches the cores' capacity, latency is queueing for CPU, not the store.
- Trials created by one configuration are deleted before the next, so ``trials`` stays the
  pre-filled count.

``python -m bench.storage_load`` prints JSON lines. Environment (defaults in brackets):
``STORAGE_LOAD_WORKERS`` [8,32,64,128], ``STORAGE_LOAD_TRIALS`` [1000,10000], ``STORAGE_LOAD_PROXY``
[0,1], ``STORAGE_LOAD_DURATION_S`` [15] (measured seconds per configuration), ``STORAGE_LOAD_PRUNER``
[median; or hyperband, the phase1 pruner], ``STORAGE_LOAD_REPORTS`` [30] (reports per trial),
``STORAGE_LOAD_PG`` [host=127.0.0.1 port=5432 user=postgres] (libpq DSN of a role that may create
databases). Target: report_prune_p99_ms < 100 at 64 workers with 10,000 trials.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

STUDY = "load"
STEPS = 10  # intermediate values of a pre-filled trial, at steps 1..STEPS (seconds)
HEARTBEAT_S = 10.0  # the sweep's default trial.heartbeat_s

def _params() -> dict[str, Any]:
    """The searched parameters of the pre-filled and the new trials (optuna imported where it is used)."""
    from optuna.distributions import FloatDistribution, IntDistribution

    return {"depth": IntDistribution(2, 12), "model_dim": IntDistribution(128, 768, step=64),
            "matrix_lr": FloatDistribution(0.005, 0.1, log=True),
            "embedding_lr": FloatDistribution(0.05, 1.0, log=True),
            "warmdown_ratio": FloatDistribution(0.2, 0.8), "weight_decay": FloatDistribution(0.0, 0.2)}

# The scalar part of a result record as the supervisor stores it (one user attribute per field).
RECORD = {
    "status": "ok", "val_loss": 2.1, "val_tokens": 1048576, "val_bytes": 4500000, "train_seconds": 1799.8,
    "startup_seconds": 95.2, "eval_seconds": 41.0, "steps": 5120, "tokens": 2684354560,
    "tokens_per_second": 1491000.0, "params": 123456789, "device": "neuron", "world_size": 4,
    "peak_memory_bytes": 17179869184, "budget_s": 1800.0, "over_budget": False, "train_loss": 2.2,
    "step_seconds_median": 0.35, "step_seconds_max": 1.2, "excluded_steps": 3, "excluded_seconds": 12.0,
    "mfu": 0.31, "slot_seconds": 1950.3, "launch_unix": 1.7e9, "first_step_unix": 1.7e9 + 95,
    "artifacts": "/runs/artifacts/phase1/0", "spec_hash": "3f2a9c0d1b2e",
}
COMPACT = ("status", "train_seconds", "steps", "slot_seconds", "spec_hash")
CONFIG = {"vocab_size": 8192, "head_dim": 128, "seq_len": 2048, "batch_size": 16, "grad_accum": 1,
          "n_kv_head": 4, "mlp_ratio": 4, "rope_base": 10000.0, "softcap": 15.0, "scalar_lr": 0.5,
          "unembedding_lr": 0.004, "muon_momentum": 0.95, "warmup_ratio": 0.0, "final_lr_frac": 0.0,
          "seed": 0, "device": "neuron", "compile": True, "kernels": "nki", "eval_tokens": 1048576,
          "final_eval_tokens": 10485760, "eval_fractions": [0.25, 0.5, 0.75], "startup_allowance_s": 900.0}


# -- a throwaway database with a pre-filled study -------------------------------------------------


def _pg_dsn() -> str:
    return os.environ.get("STORAGE_LOAD_PG", "host=127.0.0.1 port=5432 user=postgres")


@contextlib.contextmanager
def database() -> Iterator[tuple[str, str]]:
    """A fresh database, dropped afterwards; yields (name, SQLAlchemy URL)."""
    import psycopg2
    from psycopg2.extensions import parse_dsn

    dsn = parse_dsn(_pg_dsn())
    name = f"storage_load_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(**{**dsn, "dbname": dsn.get("dbname", "postgres")})
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    auth = dsn.get("user", "postgres") + (f":{dsn['password']}" if dsn.get("password") else "")
    url = f"postgresql+psycopg2://{auth}@{dsn.get('host', '127.0.0.1')}:{dsn.get('port', 5432)}/{name}"
    try:
        yield name, url
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def _connect(dbname: str) -> Any:
    import psycopg2
    from psycopg2.extensions import parse_dsn

    conn = psycopg2.connect(**{**parse_dsn(_pg_dsn()), "dbname": dbname})
    conn.autocommit = True
    return conn


def prefill(dbname: str, url: str, n: int, steps: int = STEPS, full_record: bool = False) -> int:
    """Create the study the way the driver does (indexes included) and add ``n`` finished trials.

    Plain INSERT ... SELECT over generate_series, in Optuna's schema: 90% COMPLETE with a value and
    ``steps`` intermediate values, 10% PRUNED with fewer. ``full_record`` stores the whole result
    record as user attributes, as the sweep does; otherwise a compact one (see the module docstring).
    Returns the study id.
    """
    import optuna
    from optuna.distributions import IntDistribution, distribution_to_json

    from sweep import store as st

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(url, role="driver")  # creates the schema and the sweep's indexes
    study = optuna.create_study(study_name=STUDY, storage=storage, direction="minimize")
    study_id = st.study_id(study)
    storage.engine.dispose()
    fields = dict(RECORD, config=CONFIG) if full_record else {k: RECORD[k] for k in COMPACT}
    record = [(k, json.dumps(v)) for k, v in fields.items()]
    record += [("record_fields", json.dumps(sorted([*fields, "val_bpb"])))]
    param_values = ",".join(
        f"('{name}', '{distribution_to_json(d)}', {d.low}, {d.high}, {str(d.log).lower()}, {d.step or 0}, "
        f"'{'int' if isinstance(d, IntDistribution) else 'float'}')" for name, d in _params().items())
    with _connect(dbname) as conn, conn.cursor() as cur:
        cur.execute("""
            INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete)
            SELECT g - 1, %(sid)s, (CASE WHEN g %% 10 = 0 THEN 'PRUNED' ELSE 'COMPLETE' END)::trialstate,
                   now() - make_interval(secs => (%(n)s - g) * 60 + 1800),
                   now() - make_interval(secs => (%(n)s - g) * 60)
            FROM generate_series(1, %(n)s) AS g ORDER BY g""", {"sid": study_id, "n": n})
        cur.execute("CREATE TEMP TABLE p (name text, dist text, lo float8, hi float8, lg bool, step float8, kind text)")
        cur.execute(f"INSERT INTO p VALUES {param_values}")
        cur.execute("""
            INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json)
            SELECT t.trial_id, p.name,
                   CASE WHEN p.kind = 'int' THEN p.lo + p.step * floor(random() * ((p.hi - p.lo) / p.step + 1))
                        WHEN p.lg THEN exp(ln(p.lo) + random() * (ln(p.hi) - ln(p.lo)))
                        ELSE p.lo + random() * (p.hi - p.lo) END,
                   p.dist
            FROM trials t CROSS JOIN p WHERE t.study_id = %(sid)s ORDER BY t.trial_id""", {"sid": study_id})
        # A learning curve per trial: a per-trial level plus a decay; pruned trials stop early.
        cur.execute("""
            INSERT INTO trial_intermediate_values (trial_id, step, intermediate_value, intermediate_value_type)
            SELECT t.trial_id, s, 1.0 + (t.trial_id %% 97) / 97.0 + 2.0 / s + random() * 0.05, 'FINITE'
            FROM trials t CROSS JOIN generate_series(1, %(steps)s) AS s
            WHERE t.study_id = %(sid)s AND (t.state = 'COMPLETE' OR s <= 1 + t.trial_id %% (%(steps)s / 2))
            ORDER BY t.trial_id, s""", {"sid": study_id, "steps": steps})
        cur.execute("""
            INSERT INTO trial_values (trial_id, objective, value, value_type)
            SELECT t.trial_id, 0, v.intermediate_value, 'FINITE'
            FROM trials t JOIN trial_intermediate_values v ON v.trial_id = t.trial_id AND v.step = %(steps)s
            WHERE t.study_id = %(sid)s AND t.state = 'COMPLETE' ORDER BY t.trial_id""",
                    {"sid": study_id, "steps": steps})
        cur.execute("CREATE TEMP TABLE r (key text, value_json text)")
        cur.executemany("INSERT INTO r VALUES (%s, %s)", record)
        cur.execute("""
            INSERT INTO trial_user_attributes (trial_id, key, value_json)
            SELECT t.trial_id, r.key, r.value_json FROM trials t CROSS JOIN r
            WHERE t.study_id = %(sid)s ORDER BY t.trial_id""", {"sid": study_id})
        cur.execute("""
            INSERT INTO trial_user_attributes (trial_id, key, value_json)
            SELECT v.trial_id, 'val_bpb', v.value::text FROM trial_values v JOIN trials t USING (trial_id)
            WHERE t.study_id = %(sid)s""", {"sid": study_id})
        cur.execute("""
            INSERT INTO trial_system_attributes (trial_id, key, value_json)
            SELECT t.trial_id, k.key, k.value_json FROM trials t CROSS JOIN (VALUES
                ('sweep:driver', '{"host": "head", "pid": 4242, "pid_start": 123456, "run": "0a1b2c3d"}'),
                ('sweep:started', '1700000000.0'), ('sweep:heartbeat', '1700001800.0')) AS k(key, value_json)
            WHERE t.study_id = %(sid)s ORDER BY t.trial_id""", {"sid": study_id})
        cur.execute("ANALYZE")
    return study_id


def verify_prefill(url: str, n: int, steps: int = STEPS) -> float:
    """Read the study back with Optuna (a cold read, as a fresh worker does); return its seconds."""
    import optuna

    from sweep import store as st

    storage = st.open_storage(url, role="driver")
    t0 = time.perf_counter()
    trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials(deepcopy=False)
    seconds = time.perf_counter() - t0
    states = {t.state.name for t in trials}
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(trials) == n and states <= {"COMPLETE", "PRUNED"}, (len(trials), states)
    assert [t.number for t in trials] == list(range(n))
    for t in (complete[0], complete[-1], trials[len(trials) // 2]):
        assert set(t.params) == set(_params())
        for name, value in t.params.items():
            assert t.distributions[name]._contains(t.distributions[name].to_internal_repr(value)), (name, value)
        assert t.user_attrs["status"] == "ok" and t.user_attrs["record_fields"]
    assert all(len(t.intermediate_values) == steps and t.value == t.intermediate_values[steps] for t in complete)
    storage.engine.dispose()
    return seconds


def reset(dbname: str, study_id: int, n: int) -> None:
    """Delete the trials a configuration created, so the next one starts from the pre-filled study."""
    conn = _connect(dbname)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT coalesce(max(trial_id), 0) FROM trials WHERE study_id = %s AND number < %s",
                        (study_id, n))
            (last,) = cur.fetchone()
            for table in ("trial_params", "trial_values", "trial_intermediate_values", "trial_user_attributes",
                          "trial_system_attributes", "trial_heartbeats"):
                cur.execute(f"DELETE FROM {table} WHERE trial_id > %s", (last,))
            cur.execute("DELETE FROM trials WHERE trial_id > %s", (last,))
            cur.execute("VACUUM ANALYZE")
    finally:
        conn.close()


# -- one worker process ----------------------------------------------------------------------------


def _pruner(name: str) -> Any:
    import optuna

    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=STEPS)
    if name == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=5)


def _suggest(trial: Any) -> None:
    from optuna.distributions import IntDistribution

    for name, d in _params().items():
        if isinstance(d, IntDistribution):
            trial.suggest_int(name, d.low, d.high, step=d.step)
        else:
            trial.suggest_float(name, d.low, d.high, log=d.log)


def _worker(idx: int, storage: Any, urls: Any, warm: tuple[int, dict[int, Any], int] | None,
            pruner: str, reports: int, ready: Any, start: Any, stop: Any, out: Any) -> None:
    """One worker process: connect (directly or to the proxy whose URL arrives on ``urls``), warm
    up, wait for the start, then run trials until told to stop."""
    import optuna

    from sweep import store as st

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rng = random.Random(idx)
    res: dict[str, Any] = {"report": [], "report_cpu": [], "ask": [], "errors": 0, "error": None, "pruned": 0,
                           "report_only": [], "prune_only": []}
    try:
        proxy_url = urls.get(timeout=300)
        if proxy_url:
            storage = st.open_storage(proxy_url, role="worker")
            if warm is not None:  # the cache a long-lived worker would hold, as in the direct mode
                st.seed_grpc_cache(storage, *warm)
        else:
            st.engine_of(storage).dispose(close=False)  # never share the parent's connections
        study = st.retry(lambda: optuna.load_study(study_name=STUDY, storage=storage, pruner=_pruner(pruner),
                                                   sampler=optuna.samplers.RandomSampler(seed=idx)),
                         what="load study")
        trial = study.ask()
        _suggest(trial)
        trial.report(3.0, 0)
        trial.should_prune()
        trial.should_prune()  # the first may have been served by the parent's fresh read
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        ready.release()
        out.put(res)
        return
    ready.release()
    start.wait()
    time.sleep(rng.random())  # workers report out of phase, as trials started at different times do
    # Trials end at spread-out times, as in a sweep that has run for a while.
    step, next_beat = rng.randrange(reports), time.monotonic() + HEARTBEAT_S * rng.random()
    tick = time.monotonic()
    level = 1.0 + rng.random()
    while not stop.is_set():
        tick += 1.0
        delay = tick - time.monotonic()
        if delay > 0:
            stop.wait(delay)
            if stop.is_set():
                break
        try:
            step += 1
            value = level + 2.0 / step + rng.random() * 0.05
            c0, t0 = time.thread_time(), time.perf_counter()
            trial.report(value, step)
            t1 = time.perf_counter()
            pruned = trial.should_prune()
            res["report"].append(time.perf_counter() - t0)
            res["report_only"].append(t1 - t0)
            res["prune_only"].append(time.perf_counter() - t1)
            res["report_cpu"].append(time.thread_time() - c0)
            if time.monotonic() >= next_beat:
                st.study_storage(study).set_trial_system_attr(st.trial_id(trial), "sweep:heartbeat", time.time())
                next_beat = time.monotonic() + HEARTBEAT_S
            res["pruned"] += bool(pruned)
            # The pruner's answer is recorded, not acted on: every configuration carries the same
            # load however the random values compare with the pre-filled ones.
            if step >= reports:
                study.tell(trial, value)
                t0 = time.perf_counter()
                trial = study.ask()
                _suggest(trial)
                res["ask"].append(time.perf_counter() - t0)
                step, level = 0, 1.0 + rng.random()
        except Exception as e:
            res["errors"] += 1
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    out.put(res)


# -- one configuration -----------------------------------------------------------------------------


def _connections(dbname: str, stop: threading.Event, peak: dict[str, int]) -> None:
    """Sample the database's connections (all, and those running a statement) until stopped."""
    conn = _connect("postgres")
    try:
        with conn.cursor() as cur:
            while not stop.wait(0.25):
                cur.execute("SELECT count(*), count(*) FILTER (WHERE state = 'active') FROM pg_stat_activity "
                            "WHERE datname = %s", (dbname,))
                total, active = cur.fetchone()
                peak["total"] = max(peak["total"], total)
                peak["active"] = max(peak["active"], active)
    finally:
        conn.close()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(1000 * s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 2)


def measure(dbname: str, url: str, warm_storage: Any, study_id: int, n_trials: int, workers: int, proxy: bool,
            duration_s: float, pruner: str, reports: int, cold_load_s: float) -> dict[str, Any]:
    """One configuration, in a forked child: gRPC must never run in a process that forks afterwards,
    so the workers are forked before the proxy starts and get its URL through a queue."""
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    p = ctx.Process(target=lambda: result.put(_measure(dbname, url, warm_storage, study_id, n_trials, workers, proxy,
                                                        duration_s, pruner, reports, cold_load_s)))
    p.start()
    try:
        return result.get(timeout=duration_s + 900)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()


def _measure(dbname: str, url: str, warm_storage: Any, study_id: int, n_trials: int, workers: int, proxy: bool,
             duration_s: float, pruner: str, reports: int, cold_load_s: float) -> dict[str, Any]:
    from sweep import store as st

    ctx = mp.get_context("fork")
    ready, start, stop, out, urls = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    warm = None
    if proxy:
        warm = (study_id, *st.cached_study(warm_storage, study_id))
    st.engine_of(warm_storage).dispose()
    peak = {"total": 0, "active": 0}
    sampling = threading.Event()
    procs: list[Any] = []
    handle = None
    results: list[dict[str, Any]] = []
    try:
        gc.collect()
        gc.freeze()  # the shared cache stays shared: collections in the children do not touch it
        for i in range(workers):
            w = ctx.Process(target=_worker, args=(i, warm_storage, urls, warm, pruner, reports, ready, start, stop,
                                                  out), daemon=True)
            w.start()
            procs.append(w)
        gc.unfreeze()
        handle = st.StorageProxy(url) if proxy else None
        for _ in procs:
            urls.put(handle.url if handle else "")
        sampler = threading.Thread(target=_connections, args=(dbname, sampling, peak), daemon=True)
        sampler.start()
        t_warm = time.perf_counter()
        for _ in procs:
            ready.acquire(timeout=300)
        warmup_s = time.perf_counter() - t_warm
        start.set()
        t0 = time.perf_counter()
        busy0 = _cpu_ticks()
        time.sleep(duration_s)
        busy1 = _cpu_ticks()
        stop.set()
        results = [out.get(timeout=120) for _ in procs]
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        start.set()
        for w in procs:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
        sampling.set()
        if handle is not None:
            handle.close()
    cpu_busy = round(100 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), 1)
    report = [x for r in results for x in r["report"]]
    cpu = [x for r in results for x in r["report_cpu"]]
    asks = [x for r in results for x in r["ask"]]
    failed = [r["error"] for r in results if r["error"] and not r["report"]]
    errors = sum(r["errors"] for r in results) + len(failed)
    first_error = next((r["error"] for r in results if r["error"]), None)
    row = {
        "workers": workers, "trials": n_trials, "proxy": proxy,
        "report_prune_p50_ms": _pct(report, 0.50), "report_prune_p99_ms": _pct(report, 0.99),
        "ask_p99_ms": _pct(asks, 0.99), "db_connections": peak["total"],
        "db_connections_active": peak["active"], "reports": len(report),
        "reports_per_s": round(len(report) / elapsed, 1), "asks": len(asks), "ask_p50_ms": _pct(asks, 0.50),
        "report_prune_max_ms": _pct(report, 1.0), "report_prune_cpu_p50_ms": _pct(cpu, 0.50),
        "report_p99_ms": _pct([x for r in results for x in r["report_only"]], 0.99),
        "prune_p99_ms": _pct([x for r in results for x in r["prune_only"]], 0.99),
        "errors": errors, "workers_failed": len(failed),
        "first_error": st.scrub(first_error, url) if first_error else None,
        "duration_s": round(elapsed, 1), "warmup_s": round(warmup_s, 1), "cold_load_s": round(cold_load_s, 2),
        "cpu_count": os.cpu_count(), "cpu_busy_pct": cpu_busy, "pruner": pruner, "reports_per_trial": reports,
        "prune_said_yes_pct": round(100 * sum(r["pruned"] for r in results) / max(1, len(report)), 1),
    }
    if workers == 64 and n_trials == 10000:
        p99 = row["report_prune_p99_ms"]
        row["target_p99_under_100ms"] = p99 is not None and p99 < 100 and not errors
    return row


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _env_list(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


def run() -> list[dict[str, Any]]:
    import optuna

    from sweep import store as st

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    workers = [int(x) for x in _env_list("STORAGE_LOAD_WORKERS", "8,32,64,128")]
    sizes = [int(x) for x in _env_list("STORAGE_LOAD_TRIALS", "1000,10000")]
    proxies = [x.lower() in ("1", "true", "yes") for x in _env_list("STORAGE_LOAD_PROXY", "0,1")]
    duration_s = float(os.environ.get("STORAGE_LOAD_DURATION_S", "15"))
    pruner = os.environ.get("STORAGE_LOAD_PRUNER", "median")
    reports = int(os.environ.get("STORAGE_LOAD_REPORTS", "30"))
    full_record = os.environ.get("STORAGE_LOAD_RECORD", "compact") == "full"
    rows: list[dict[str, Any]] = []
    for n in sizes:
        with database() as (dbname, url):
            t0 = time.perf_counter()
            study_id = prefill(dbname, url, n, full_record=full_record)
            prefill_s = time.perf_counter() - t0
            cold_s = verify_prefill(url, n)
            print(f"storage_load: {n} trials pre-filled in {prefill_s:.1f}s, read back by Optuna in {cold_s:.1f}s",
                  file=sys.stderr, flush=True)
            # The warm cache every worker forks with (see the module docstring).
            warm = st.open_storage(url, role="worker")
            gc.collect()
            rss0, t0 = _rss_mb(), time.perf_counter()
            warm.get_all_trials(study_id, deepcopy=False)
            cold_load_s, cache_mb = time.perf_counter() - t0, _rss_mb() - rss0
            for proxy in proxies:
                for w in workers:
                    reset(dbname, study_id, n)
                    row = measure(dbname, url, warm, study_id, n, w, proxy, duration_s, pruner, reports, cold_load_s)
                    row["cache_mb"] = round(cache_mb)
                    row["record"] = "full" if full_record else "compact"
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            st.engine_of(warm).dispose()
            st.forget_shared()
    return rows


def _summary(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"  {r['workers']:>4} workers {r['trials']:>6} trials proxy={str(r['proxy']):<5} "
              f"p50 {r['report_prune_p50_ms']} ms p99 {r['report_prune_p99_ms']} ms ask p99 {r['ask_p99_ms']} ms "
              f"conns {r['db_connections']} errors {r['errors']}", file=sys.stderr)


if __name__ == "__main__":
    rows = run()
    for row in rows:
        print(json.dumps({"suite": "storage_load", **row}), flush=True)
    _summary(rows)
