"""``python -m sweep precompile NAME``: compile a study's graph shapes into the shared cache ahead of its trials.

Cold Neuron compiles take minutes per shape, and a 30-minute trial pays them inside its start-up
allowance. The graphs a trial compiles depend only on the settings :func:`sweep.neuron.graph.graph_key`
hashes, so a study asks for a finite set of them when every parameter that reaches the key is
discrete. This command lists that set (``--dry-run`` prints it as JSON, anywhere) and runs one
compile-only trainer per shape as a Ray task with a trial's resources, spread over the nodes: the
same supervisor and launch plan as a trial, the trainer stopping after its uncharged steps plus one
(``max_steps``) with no checkpoint and one batch of evaluation. The compiled graphs land where trials
look (``trial.compile_cache``; node directories reach the other nodes through infra's S3 sync), and
the keys are stored on the study (``precompiled_graph_keys``) so the driver prefers enqueued trials
that are warm.

Enumeration: parameters that reach the key (directly, through ``[derived]`` values, or through a
``when`` of such a parameter) are enumerated over their values (categorical, int, float with a
step); a continuous one is refused, since it has no finite set of shapes. Each combination is
completed with sampled values of the other parameters until the constraints hold (at most
``COMPLETIONS`` tries; a combination no completion satisfies is dropped) and combinations with equal
keys count once. Neuron compiles only on Trainium, so on a Ray without ``neuron_cores`` the command
says so and exits 2.

Ray and Optuna are imported where they are used: the command line imports this module for every
command, and they take seconds to load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from sweep import neuron
from sweep import store as st
from sweep.run.driver import quiet_local_token_notice
from sweep.run.supervisor import Supervisor, TrialTask
from sweep.spec.expr import ExprError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MAX_SHAPES = 64
MAX_COMBINATIONS = 100_000  # before constraints and deduplication
COMPLETIONS = 32
EXCLUDED_STEPS_DEFAULT: int = neuron.TRAINER_DEFAULTS["excluded_steps"]


class PrecompileError(ValueError):
    """Bad input for precompile; exit 2 with this one line."""


@dataclass(frozen=True)
class Shape:
    key: str
    values: dict[str, Any]  # the enumerated parameters
    point: dict[str, Any]  # a complete feasible point with those values
    shape: dict[str, Any]  # what the key hashes


# -- enumeration ------------------------------------------------------------------------------------

def graph_params(space: Any) -> list[str]:
    """Searched parameters that can change the graph key, in the space's order."""
    params = {p.name: p for p in space.params}
    derived = dict(space.derived)

    def params_of(names: set[str], seen: set[str]) -> set[str]:
        out = set()
        for n in names:
            if n in params:
                out.add(n)
            elif n in derived and n not in seen:
                out |= params_of(set(derived[n].names), seen | {n})
        return out

    relevant = {n for n in params if n in neuron.GRAPH_INPUTS}
    for name, e in space.derived:
        if name in neuron.GRAPH_INPUTS:
            relevant |= params_of(set(e.names), {name})
    while True:  # a `when` deciding whether a relevant parameter exists is relevant too
        more = set().union(*(params_of(set(params[n].when.names), set()) for n in relevant
                             if params[n].when is not None)) - relevant
        if not more:
            return [p.name for p in space.params if p.name in relevant]
        relevant |= more


def values_of(p: Any) -> list[Any]:
    """Every value of a discrete parameter; PrecompileError for a continuous one."""
    if p.kind == "categorical":
        return list(p.choices)
    if p.kind == "int":
        return list(range(p.low, p.high + 1, p.step or 1))
    if p.step:
        n = round((p.high - p.low) / p.step)
        return [round(p.low + i * p.step, 12) for i in range(n + 1)]
    raise PrecompileError(f"params.{p.name}: changes compiled shapes but is continuous (a float without a step); "
                          "give it choices or a step to precompile")


def enumerate_shapes(spec: Any, max_shapes: int = DEFAULT_MAX_SHAPES, seed: int = 0) -> tuple[list[str], list[Shape]]:
    """(the parameters enumerated, the distinct graph shapes of feasible points), in a stable order."""
    space = spec.space
    names = graph_params(space)
    by_name = {p.name: p for p in space.params}
    domains = {n: values_of(by_name[n]) for n in names}
    bound = math.prod(len(v) for v in domains.values())
    if bound > MAX_COMBINATIONS:
        raise PrecompileError(f"{spec.path}: {bound} combinations of {', '.join(names)} to enumerate "
                              f"(more than {MAX_COMBINATIONS}); fix some of them to precompile")
    rng = random.Random(seed)
    shapes: dict[str, Shape] = {}
    for combo in _combinations(space, set(names), domains):
        point = _complete(space, combo, rng)
        if point is None:
            continue
        config = space.trainer_config(point)
        try:
            key = neuron.graph_key(config, spec.ranks, spec.env)
        except neuron.LaunchError as e:
            raise PrecompileError(f"{spec.path}: {e}") from None
        if key not in shapes:
            shapes[key] = Shape(key, combo, point, neuron.graph_shape(config, spec.ranks, spec.env))
            if len(shapes) > max_shapes:
                raise PrecompileError(f"{spec.path}: more than {max_shapes} graph shapes (varying "
                                      f"{', '.join(names)}); narrow the study or pass --max-shapes")
    return names, list(shapes.values())


def _combinations(space: Any, relevant: set[str], domains: dict[str, list[Any]]) -> Any:
    params = list(space.params)

    def walk(i: int, env: dict[str, Any], chosen: dict[str, Any]) -> Any:
        if i == len(params):
            yield dict(chosen)
            return
        p = params[i]
        if p.name not in relevant or (p.when is not None and not _holds(p, env)):
            yield from walk(i + 1, env, chosen)
            return
        for v in domains[p.name]:
            yield from walk(i + 1, {**env, p.name: v}, {**chosen, p.name: v})

    yield from walk(0, dict(space.fixed), {})


def _holds(p: Any, env: dict[str, Any]) -> bool:
    try:
        return bool(p.when(env))
    except ExprError as e:
        raise PrecompileError(f"params.{p.name}.when: {e}") from None


def _complete(space: Any, combo: dict[str, Any], rng: random.Random) -> dict[str, Any] | None:
    """A feasible point with ``combo``'s values, the other parameters sampled; None if none is found."""
    for _ in range(COMPLETIONS):
        env: dict[str, Any] = {**space.fixed, **combo}
        point: dict[str, Any] = {}
        for p in space.params:
            if p.name in combo:
                point[p.name] = combo[p.name]
            elif p.name not in env and (p.when is None or _holds(p, env)):
                point[p.name] = env[p.name] = p.sample(rng)
        try:
            _, broken = space.complete(point)
        except Exception:
            continue
        if broken is None:
            return point
    return None


# -- compile-only runs ------------------------------------------------------------------------------

def compile_config(spec: Any, shape: Shape) -> dict[str, Any]:
    """The trainer config of a compile-only run: the shape's point, stopping right after compiling."""
    config = spec.space.trainer_config(shape.point)
    batch = int(config.get("batch_size", neuron.GRAPH_DEFAULTS["batch_size"]))
    seq = int(config.get("seq_len", neuron.GRAPH_DEFAULTS["seq_len"]))
    tokens = batch * seq * shape.shape["ranks"]  # one evaluation batch per rank
    excluded = int(config.get("excluded_steps", EXCLUDED_STEPS_DEFAULT))
    return {**config, "max_steps": excluded + 1, "save_checkpoint": False, "eval_fractions": [],
            "eval_tokens": tokens, "final_eval_tokens": tokens, "startup_allowance_s": spec.startup_allowance_s}


def compile_task(spec: Any, shape: Shape, number: int) -> TrialTask:
    return TrialTask(
        study=spec.name, storage_url="", number=number, trial_id=-1, params=shape.point,
        config=compile_config(spec, shape), budget_s=1.0,
        deadline_s=1.0 + spec.startup_allowance_s + spec.eval_timeout_s, eval_fractions=(1.0,), ranks=spec.ranks,
        trainer=spec.trainer, stop_grace_s=spec.stop_grace_s, heartbeat_s=spec.heartbeat_s, env=dict(spec.env),
        compile_cache=spec.compile_cache,
    )


def _compile_one(task: TrialTask, key: str) -> dict[str, Any]:
    """Ray task body: one compile-only run under the trial supervisor (no study writes)."""
    root = os.environ.get("SWEEP_ARTIFACTS") or ""  # this node's, as trials' working files
    root_dir = REPO_ROOT / "runs" / "artifacts" if not root or root.startswith("s3://") else Path(root)
    work = root_dir / task.study / "precompile" / key
    if work.exists():
        shutil.rmtree(work, ignore_errors=True)
    sup = Supervisor(replace(task, artifact_dir=str(work)))
    t0 = time.monotonic()
    try:
        out = sup.run()
    finally:
        sup.close()
    attrs = sup.launch_attrs
    ok = out.state == "COMPLETE" or (out.record or {}).get("status") == "ok"
    return {"graph_key": key, "ok": ok, "state": out.state, "reason": out.reason, "seconds": round(time.monotonic()
            - t0, 1), **{k: attrs[k] for k in ("graph_cache", "graph_cache_new_entries", "compile_seconds",
                                               "startup_wall_seconds", "neuron_rank_cores") if k in attrs}}


def run(spec: Any, shapes: list[Shape], url: str | None, out: TextIO, require: str | None = "neuron_cores") -> int:
    """Compile every shape on the cluster; JSON lines as they finish. 0 when all compiled, 1 otherwise."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if require and not address and shutil.which("neuron-ls") is None:
        raise PrecompileError(_NO_NEURON)
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"namespace": "trnsweep", "log_to_driver": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            with quiet_local_token_notice():
                ray.init(address="local", include_dashboard=False, num_cpus=os.cpu_count() or 1,
                         object_store_memory=200 * 1024**2, **kwargs)
            started = True
    try:
        if require and ray.cluster_resources().get(require, 0) <= 0:
            raise PrecompileError(_NO_NEURON)
        remote = ray.remote(_compile_one)
        opts = {"max_retries": 0, "scheduling_strategy": "SPREAD", **spec.resources.ray_options()}
        refs = {remote.options(name=f"{spec.name}-precompile-{i}", **opts).remote(compile_task(spec, s, i), s.key): s
                for i, s in enumerate(shapes)}
        done: list[str] = []
        failed = 0
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            shape = refs.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                result = {"graph_key": shape.key, "ok": False, "reason": str(e).splitlines()[0][:300]}
            result["values"] = shape.values
            print(json.dumps(result, default=str), file=out, flush=True)
            if result.get("ok"):
                done.append(shape.key)
            else:
                failed += 1
        if url and done:
            _remember(spec, url, done)
        print(json.dumps({"study": spec.name, "compiled": len(done), "failed": failed}), file=out, flush=True)
        return 0 if not failed else 1
    finally:
        if started:
            ray.shutdown()


_NO_NEURON = ("this Ray has no neuron_cores: Neuron compiles only on Trainium, so precompiling happens on the "
              "cluster (RAY_ADDRESS=<head>:6379 python -m sweep precompile NAME); --dry-run lists the shapes here")


def _remember(spec: Any, url: str, keys: list[str]) -> None:
    """Store the compiled keys on the study (creating it if need be) for the driver's warm preference."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(url)
    study = st.retry(lambda: optuna.create_study(study_name=spec.name, storage=storage, directions=spec.directions,
                                                 load_if_exists=True), url=url)
    have = set(study.user_attrs.get(neuron.ATTR_PRECOMPILED, []))
    st.retry(lambda: study.set_user_attr(neuron.ATTR_PRECOMPILED, sorted(have | set(keys))), url=url)


# -- command line -----------------------------------------------------------------------------------

def add_parser(sub: Any) -> None:
    p = sub.add_parser("precompile", help="compile a study's graph shapes into the Neuron cache ahead of its trials")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    p.add_argument("--dry-run", action="store_true", help="print the graph shapes and keys as JSON; compile nothing")
    p.add_argument("--max-shapes", type=int, default=DEFAULT_MAX_SHAPES, metavar="N",
                   help=f"refuse a study with more distinct shapes than this (default {DEFAULT_MAX_SHAPES})")


def main(spec: Any, url: str | None, args: argparse.Namespace, out: TextIO) -> int:
    try:
        names, shapes = enumerate_shapes(spec, max(1, args.max_shapes))
        if args.dry_run:
            body = {"study": spec.name, "graph_params": names, "count": len(shapes),
                    "shapes": [{"graph_key": s.key, "values": s.values, "shape": s.shape} for s in shapes]}
            print(json.dumps(body, indent=1, default=str), file=out, flush=True)
            return 0
        return run(spec, shapes, url, out)
    except PrecompileError as e:
        print(f"sweep: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
