"""Study specs: one TOML file per study, validated strictly at load time.

A spec is data a person edits between cluster runs, so every mistake must surface before any
accelerator is reserved: an unknown key, a wrong type, an empty range, a constraint no point can
satisfy, an unknown sampler or pruner option. Each becomes a :class:`SpecError` whose single line
names the file and the key. See ``sweep/studies/demo.toml`` for an annotated example.

This module validates the sections into a :class:`StudySpec`; reading the file (and ``extends``) is
:mod:`sweep.spec.files`, the sampler and pruner tables are :mod:`sweep.spec.components`.

Long file: the spec's sections are validated in one pass, since later sections' checks need earlier ones
(the budget for the pruner, the ranks for the resources, the space for the script's knobs).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sweep import neuron
from sweep.neuron.environment import COMPETITION_VENV, DEFAULT_PROFILE, PROFILES, Environment
from sweep.spec import expr
from sweep.spec import objective as obj
from sweep.spec import script as script_spec
from sweep.spec.components import Component, exercise_components, read_pruner, read_sampler
from sweep.spec.files import SpecReader, name_problem, read_spec_file, resolve_path
from sweep.spec.limits import ENV_MEMORY_MB, LimitError, memory_limit_bytes
from sweep.spec.space import Param, SearchSpace, SpaceError

_CONSTRAINT_SAMPLES = 1000


@dataclass(frozen=True)
class Resources:
    """What one trial reserves in Ray; ``neuron_cores`` is Ray's resource for Trainium cores."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    neuron_cores: int = 0

    def ray_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.neuron_cores:
            opts["resources"] = {"neuron_cores": self.neuron_cores}
        return opts

    def as_dict(self) -> dict[str, float]:
        """Per-trial demand keyed by Ray resource name, zero entries left out."""
        d = {"CPU": self.num_cpus, "GPU": self.num_gpus, "neuron_cores": float(self.neuron_cores)}
        return {k: v for k, v in d.items() if v}


SIDE = "side"  # a comparison trial's side: "base", "cand", "cand2", ... (sweep.compare)
PAIR = "pair"  # which pair (one seed on one node) a comparison trial belongs to
COMPARE_KEYS = (SIDE, PAIR)


@dataclass(frozen=True)
class Side:
    """What one side of a comparison runs: a script (or our trainer, ``script`` None) with fixed parameters.

    ``space`` computes its trainer config (fixed and derived values, ``seed`` searched) from ``params`` and
    the trial's seed."""

    label: str
    script: script_spec.ScriptSpec | None
    params: Mapping[str, Any]
    space: SearchSpace


@dataclass(frozen=True)
class StudySpec:
    """A validated study spec. Durations are seconds; ``space`` holds params, derived and constraints."""

    name: str
    path: Path
    direction: str
    n_trials: int
    concurrency: int | None  # None: as many as the cluster's resources allow
    seed: int | None
    storage: str | None
    artifacts: str | None
    budget_s: float
    startup_allowance_s: float
    eval_timeout_s: float
    eval_fractions: tuple[float, ...]
    ranks: int
    trainer: str
    stop_grace_s: float
    heartbeat_s: float
    stale_after_s: float
    env: Mapping[str, str]
    resources: Resources
    sampler: Component
    pruner: Component
    space: SearchSpace
    storage_proxy: bool = False  # workers reach the store through a gRPC proxy the driver starts
    cost_cap_usd: float | None = None  # `make sweep` refuses to start a study estimated past it (infra.cost)
    compile_cache: str = ""  # Neuron compile cache: "" the node's directory, else a shared path or s3:// (sweep.neuron)
    objective: obj.Objective = field(default_factory=obj.Objective)  # what is told to Optuna (sweep.spec.objective)
    chips: int = 0  # Trainium2 chips per trial (trial.chips); 0: resources as written
    max_concurrency: int | None = None  # "auto": the most trials at once, and what the autoscaler is asked for
    # The driver against failing infrastructure (sweep.run.health): stop after this many trials in a row ended
    # the same way (0: never), and how long to wait on a cluster for nodes that can hold a trial again.
    max_failures_in_a_row: int = 5
    infra_wait_s: float = 600.0
    script: script_spec.ScriptSpec | None = None  # a study of a team's own script (sweep.spec.script)
    environment: Environment = field(default_factory=Environment)  # [environment]: where trials run
    # A comparison's sides (sweep.compare): a trial's ``side`` parameter picks what it runs; empty elsewhere.
    sides: Mapping[str, Side] = field(default_factory=dict)

    def trainer_config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The config the trainer gets for a trial's parameters: the space's flat dict, or, for a study of a
        script, the script trainer's (the constants to set). A comparison's trial runs its side's."""
        if self.sides:
            side = self.sides[params[SIDE]]
            flat = side.space.trainer_config({**side.params, **{k: v for k, v in params.items()
                                                                if k not in COMPARE_KEYS}})
            return side.script.trainer_config(flat) if side.script is not None else flat
        flat = self.space.trainer_config(params)
        return self.script.trainer_config(flat) if self.script is not None else flat

    def script_for(self, params: Mapping[str, Any]) -> script_spec.ScriptSpec | None:
        """The script a trial with ``params`` runs (its side's, in a comparison)."""
        if self.sides and params.get(SIDE) in self.sides:
            return self.sides[params[SIDE]].script
        return self.script

    @property
    def directions(self) -> list[str]:
        """One Optuna direction per objective value."""
        return list(self.objective.directions)

    @property
    def deadline_s(self) -> float:
        """Hard wall-clock limit of one trainer run: budget + start-up allowance + eval timeout."""
        return self.budget_s + self.startup_allowance_s + self.eval_timeout_s

    @property
    def eval_steps(self) -> tuple[int, ...]:
        """Intermediate-report steps: the nominal eval points in whole charged seconds."""
        return tuple(round(f * self.budget_s) for f in self.eval_fractions)

    @property
    def final_step(self) -> int:
        """Step at which the final val_bpb is reported, for learning curves."""
        return round(self.budget_s)

    def eval_step(self, progress: float) -> int:
        """Map an eval event's progress to the nearest nominal eval point's step.

        Pruners compare trials at equal steps, so the step must not depend on how far the last
        training step overshot the eval point.
        """
        i = min(range(len(self.eval_fractions)), key=lambda j: abs(self.eval_fractions[j] - progress))
        return self.eval_steps[i]


def load(name_or_path: str | os.PathLike[str]) -> StudySpec:
    """Load and validate a spec by study name or path; raises :class:`SpecError`."""
    path = resolve_path(name_or_path)
    return parse(read_spec_file(path, ()), path)


def parse(data: Mapping[str, Any], path: Path) -> StudySpec:
    """Validate an already-decoded spec; ``path`` is used in messages and for the default name."""
    r = SpecReader(path)
    root = r.table(data, "", {"study", "trial", "sampler", "pruner", "fixed", "params", "derived", "constraints",
                              "objective", "environment"})
    study = r.table(root.get("study", {}), "study",
                    {"name", "direction", "n_trials", "concurrency", "max_concurrency", "seed", "storage", "artifacts",
                     "storage_proxy", "cost_cap_usd", "max_failures_in_a_row", "infra_wait_s"})
    trial = r.table(root.get("trial", {}), "trial",
                    {"budget_s", "startup_allowance_s", "eval_timeout_s", "eval_fractions", "ranks", "trainer",
                     "stop_grace_s", "heartbeat_s", "stale_after_s", "env", "resources", "compile_cache", "chips",
                     *script_spec.KEYS})

    name = r.string(study, "study.name", default=path.stem)
    if problem := name_problem(name):
        raise r.error("study.name", problem)
    direction = r.choice(study, "study.direction", ("minimize", "maximize"), default="minimize")
    n_trials = r.integer(study, "study.n_trials", low=1)
    conc = study.get("concurrency", "auto")
    if conc != "auto" and (not isinstance(conc, int) or isinstance(conc, bool) or conc < 1):
        raise r.error("study.concurrency", f'must be a positive integer or "auto", got {conc!r}')
    concurrency = None if conc == "auto" else conc
    max_concurrency = r.integer(study, "study.max_concurrency", low=1, default=None)
    if max_concurrency is not None and concurrency is not None:
        raise r.error("study.max_concurrency", 'goes with concurrency = "auto" (an integer concurrency is the maximum)')
    seed = r.integer(study, "study.seed", default=None)
    storage = r.string(study, "study.storage", default=None)
    artifacts = r.string(study, "study.artifacts", default=None)
    cost_cap_usd = r.number(study, "study.cost_cap_usd", low=0, default=None)
    max_failures_in_a_row = r.integer(study, "study.max_failures_in_a_row", low=0, default=5)
    infra_wait_s = r.number(study, "study.infra_wait_s", low=0, default=600.0)
    storage_proxy = study.get("storage_proxy", False)
    if not isinstance(storage_proxy, bool):
        raise r.error("study.storage_proxy", f"must be true or false, got {storage_proxy!r}")

    budget_s = r.number(trial, "trial.budget_s", low=0, strict=True)
    startup_allowance_s = r.number(trial, "trial.startup_allowance_s", low=0, default=0.0)
    eval_timeout_s = r.number(trial, "trial.eval_timeout_s", low=0, strict=True)
    fractions = _eval_fractions(r, trial, budget_s)
    ranks = r.integer(trial, "trial.ranks", low=1, default=1)
    trainer = r.string(trial, "trial.trainer", default="model.train")
    compile_cache = r.string(trial, "trial.compile_cache", default="")
    stop_grace_s = r.number(trial, "trial.stop_grace_s", low=0, strict=True, default=30.0)
    heartbeat_s = r.number(trial, "trial.heartbeat_s", low=0, strict=True, default=10.0)
    stale_after_s = r.number(trial, "trial.stale_after_s", low=0, strict=True, default=max(120.0, 6 * heartbeat_s))
    if stale_after_s < 2 * heartbeat_s:
        raise r.error("trial.stale_after_s", f"must be at least twice trial.heartbeat_s ({heartbeat_s})")
    env_table = r.table(trial.get("env", {}), "trial.env", None)
    env = {}
    for k, v in env_table.items():
        if not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise r.error(f"trial.env.{k}", "must be a string or number")
        env[k] = str(v)
    try:
        memory_limit_bytes(env)
    except LimitError as e:
        raise r.error(f"trial.env.{ENV_MEMORY_MB}", str(e).split(": ", 1)[-1]) from None
    res = r.table(trial.get("resources", {}), "trial.resources", {"num_cpus", "num_gpus", "neuron_cores"})
    resources = Resources(
        # a CPU core per rank unless the spec says otherwise: torchrun's ranks each run a process
        num_cpus=r.number(res, "trial.resources.num_cpus", low=0, default=float(ranks)),
        num_gpus=r.number(res, "trial.resources.num_gpus", low=0, default=0.0),
        neuron_cores=r.integer(res, "trial.resources.neuron_cores", low=0, default=0),
    )
    chips = r.integer(trial, "trial.chips", low=1, default=None) or 0
    if chips:
        resources = _chip_resources(r, chips, resources, "neuron_cores" in res)

    sampler = read_sampler(r, root.get("sampler", {"name": "tpe"}), seed)
    pruner = read_pruner(r, root.get("pruner", {"name": "none"}), fractions, budget_s)
    exercise_components(r, sampler, pruner, [max(1, round(f * budget_s)) for f in fractions])

    objective_t = dict(r.table(root.get("objective", {}), "objective", None))
    trust_script = objective_t.pop("trust_script", False)
    if not isinstance(trust_script, bool):
        raise r.error("objective.trust_script", f"must be true or false, got {trust_script!r}")
    objective = _objective(r, objective_t, direction, "direction" in study, pruner,
                           r.table(root.get("fixed", {}), "fixed", None))
    direction = objective.directions[0]
    space = _space(r, root, _chip_ranks(chips, "ranks" in trial, env) if chips else None)
    launch_error = neuron.check_spec(space, resources.neuron_cores, ranks, "ranks" in trial, env, compile_cache)
    if launch_error:
        raise r.error(*launch_error)
    script = script_spec.read(r, trial, r.table(root.get("params", {}), "params", None), space, _text(path))
    if trust_script:  # the script's own printed figure as the objective: the study opts in, every trial says so
        if script is None:
            raise r.error("objective.trust_script", "only for a study of a script (trial.script)")
        script = dataclasses.replace(script, trust_script=True)
    if script is not None:
        trainer = script_spec.TRAINER
        if pruner.name == "learning_curve":
            raise r.error("pruner.name", "the learning_curve pruner models our trainer's schedules; a script's "
                                         "curve is its own: use median or hyperband")
    spec = StudySpec(
        name=name, path=path, direction=direction, n_trials=n_trials, concurrency=concurrency, seed=seed,
        storage=storage, artifacts=artifacts, budget_s=budget_s, startup_allowance_s=startup_allowance_s,
        eval_timeout_s=eval_timeout_s, eval_fractions=fractions, ranks=ranks, trainer=trainer,
        stop_grace_s=stop_grace_s, heartbeat_s=heartbeat_s, stale_after_s=stale_after_s, env=env,
        resources=resources, sampler=sampler, pruner=pruner, space=space, storage_proxy=storage_proxy,
        compile_cache=compile_cache, cost_cap_usd=cost_cap_usd, objective=objective, chips=chips,
        max_concurrency=max_concurrency, max_failures_in_a_row=max_failures_in_a_row, infra_wait_s=infra_wait_s,
        script=script, environment=_environment(r, root.get("environment", {})),
    )
    return spec


def _environment(r: SpecReader, raw: Any) -> Environment:
    """``[environment]``: ``profile`` (competition or latest-sdk) and, for competition, the image venv's name."""
    table = r.table(raw, "environment", {"profile", "venv"})
    profile = r.choice(table, "environment.profile", PROFILES, default=DEFAULT_PROFILE)
    venv = r.string(table, "environment.venv", default=COMPETITION_VENV)
    if not venv or any(c.isspace() for c in venv):
        raise r.error("environment.venv", f"must be a venv name or absolute path without spaces, got {venv!r}")
    if "venv" in table and profile != "competition":
        raise r.error("environment.venv", "goes with profile = \"competition\" (latest-sdk builds its own venv)")
    return Environment(profile=profile, venv=venv)


def _text(path: Path) -> str:
    """The spec file's text, for line numbers in messages ("" when it cannot be read again)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _eval_fractions(r: SpecReader, trial: Mapping[str, Any], budget_s: float) -> tuple[float, ...]:
    key = "trial.eval_fractions"
    raw = trial.get("eval_fractions", [0.25, 0.5, 0.75])
    if not isinstance(raw, list) or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in raw):
        raise r.error(key, "must be a list of numbers")
    fractions = tuple(float(f) for f in raw)
    if any(not 0 < f <= 1 for f in fractions):
        raise r.error(key, f"every fraction must lie in (0, 1], got {list(fractions)}")
    if list(fractions) != sorted(set(fractions)):
        raise r.error(key, "must be strictly increasing")
    steps = [round(f * budget_s) for f in fractions]
    if len(set(steps)) != len(steps):
        raise r.error(key, f"eval points collide on the charged-second axis at budget {budget_s:g} s ({steps}); "
                      "use fewer evals or a longer budget")
    return fractions


def _chip_resources(r: SpecReader, chips: int, resources: Resources, cores_given: bool) -> Resources:
    """``trial.chips``: the Ray reservation of K whole chips, counted at the cluster's LNC like Ray counts them."""
    if chips > neuron.MAX_CHIPS:
        raise r.error("trial.chips", f"a trial runs on one node: at most {neuron.MAX_CHIPS} chips (trn2.48xlarge), "
                                     f"got {chips}")
    cores = neuron.chip_cores(chips, neuron.DEFAULT_NODE_LNC)
    if cores_given and resources.neuron_cores != cores:
        raise r.error("trial.resources.neuron_cores",
                      f"{resources.neuron_cores} disagrees with trial.chips = {chips} ({cores} NeuronCores at the "
                      f"cluster's LNC {neuron.DEFAULT_NODE_LNC}); keep one")
    if resources.num_gpus:
        raise r.error("trial.resources.num_gpus", "trial.chips reserves Trainium chips; a trial cannot also hold GPUs")
    return Resources(num_cpus=resources.num_cpus, num_gpus=0.0, neuron_cores=cores)


def _chip_ranks(chips: int, ranks_given: bool, env: Mapping[str, str]) -> tuple[int, int] | None:
    """(chips, LNC when the study sets none) for the implicit ``ranks``; None when trial.ranks is given."""
    if ranks_given:
        return None
    lnc = env.get(neuron.LNC_VAR, "")
    return chips, int(lnc) if lnc in ("1", "2") else neuron.DEFAULT_NODE_LNC


def _space(r: SpecReader, root: Mapping[str, Any], chip_ranks: tuple[int, int] | None = None) -> SearchSpace:
    fixed = r.table(root.get("fixed", {}), "fixed", None)
    params_t = r.table(root.get("params", {}), "params", None)
    derived_t = r.table(root.get("derived", {}), "derived", None)
    constraints_t = r.table(root.get("constraints", {}), "constraints", None)

    params = [_param(r, name, raw) for name, raw in params_t.items()]
    derived: list[tuple[str, expr.Expr]] = []
    for name, src in derived_t.items():
        derived.append((name, _expr(r, f"derived.{name}", src)))
    if chip_ranks and "ranks" not in {*fixed, *params_t, *derived_t}:
        # One torchrun rank per logical core of the trial's chips, at the trial's LNC where the study sets
        # one; placed where lnc is known, so later derived values and constraints may use ranks.
        chips, default_lnc = chip_ranks
        if "lnc" in {*fixed, *params_t, *derived_t}:
            at = 1 + list(derived_t).index("lnc") if "lnc" in derived_t else 0
            derived.insert(at, ("ranks", expr.parse(f"{chips} * {neuron.CORES_PER_CHIP} // lnc")))
        else:
            derived.insert(0, ("ranks", expr.parse(str(neuron.chip_cores(chips, default_lnc)))))
    constraints: list[tuple[str, expr.Expr]] = []
    for name, src in constraints_t.items():
        constraints.append((name, _expr(r, f"constraints.{name}", src)))

    try:
        space = SearchSpace.build(params, derived, constraints, fixed)
    except SpaceError as e:
        raise r.error(e.key, str(e.message)) from None
    _check_satisfiable(r, space)
    return space


def _objective(r: SpecReader, raw: Any, direction: str, direction_given: bool, pruner: Component,
               fixed: Mapping[str, Any]) -> obj.Objective:
    """``[objective]``: single (default), pareto or composite; see :mod:`sweep.spec.objective`."""
    t = r.table(raw, "objective", {"type", "metrics", "terms"})
    kind = r.choice(t, "objective.type", obj.KINDS, default="single")
    if kind == "single":
        for k in ("metrics", "terms"):
            if k in t:
                raise r.error(f"objective.{k}", 'only for type = "pareto" or "composite"; single optimises '
                                               "val_bpb in study.direction")
        return obj.Objective("single", ("val_bpb",), (direction,))
    known = ", ".join(obj.DIRECTIONS)
    if kind == "pareto":
        if "terms" in t:
            raise r.error("objective.terms", 'only for type = "composite"')
        metrics = t.get("metrics")
        if not isinstance(metrics, list) or len(metrics) < 2 or not all(isinstance(m, str) for m in metrics):
            raise r.error("objective.metrics", f"must list two or more record fields (of {known}), got {metrics!r}")
        for m in metrics:
            if m not in obj.DIRECTIONS:
                raise r.error("objective.metrics", f"{m!r} has no known direction; one of {known}")
        if len(set(metrics)) != len(metrics):
            raise r.error("objective.metrics", "a metric is listed twice")
        if direction_given:
            raise r.error("study.direction", f"a pareto objective takes one direction per metric "
                                             f"({', '.join(obj.DIRECTIONS[m] for m in metrics)}); remove it")
        if pruner.name != "none":
            raise r.error("pruner.name", f"Optuna cannot prune a multi-objective (pareto) study; use \"none\", "
                                         f"got {pruner.name!r}")
        objective = obj.Objective("pareto", tuple(metrics), tuple(obj.DIRECTIONS[m] for m in metrics))
    else:
        if "metrics" in t:
            raise r.error("objective.metrics", "a composite objective lists its metrics as [objective.terms.NAME]")
        if direction_given and direction != "maximize":
            raise r.error("study.direction", 'a composite objective is maximised (1 at best, 0 at worst); '
                                             'remove it or say "maximize"')
        terms_t = r.table(t.get("terms", {}), "objective.terms", None)
        if not terms_t:
            raise r.error("objective.terms", "a composite objective needs at least one [objective.terms.NAME] "
                                             "with weight, best and worst")
        terms = [_term(r, name, v) for name, v in terms_t.items()]
        objective = obj.Objective("composite", tuple(x.metric for x in terms), ("maximize",), tuple(terms))
        if pruner.name != "none" and not objective.reports:
            raise r.error("pruner.name", "a composite objective is pruned on its val_bpb term; add "
                                         "[objective.terms.val_bpb] or use \"none\"")
    if pruner.name == "learning_curve" and objective.directions != ("minimize",):
        raise r.error("pruner.name", "the learning_curve pruner predicts a minimised val_bpb; this study is "
                                     f"{kind} ({', '.join(objective.directions)}): use median or hyperband")
    needs = sorted(obj.NEEDS_CORE & set(objective.metrics))
    if needs and not (isinstance(fixed.get("core_bundle"), str) and fixed["core_bundle"]):
        raise r.error("fixed.core_bundle", f"the {kind} objective uses {', '.join(needs)}, which only a trainer "
                                           'running CORE reports; set core_bundle (a bundle path, or "demo")')
    return objective


def _term(r: SpecReader, name: str, raw: Any) -> obj.Term:
    key = f"objective.terms.{name}"
    t = r.table(raw, key, {"weight", "best", "worst"})
    if name not in obj.DIRECTIONS:
        raise r.error(key, f"{name!r} is not a metric the objective knows; one of {', '.join(obj.DIRECTIONS)}")
    weight = r.number(t, f"{key}.weight", low=0, strict=True)
    best, worst = r.number(t, f"{key}.best"), r.number(t, f"{key}.worst")
    minimised = obj.DIRECTIONS[name] == "minimize"
    if (best >= worst) if minimised else (best <= worst):
        raise r.error(f"{key}.best", f"{name} is {'minimised' if minimised else 'maximised'}: best must be "
                                     f"{'below' if minimised else 'above'} worst, got best {best:g}, worst {worst:g}")
    return obj.Term(name, weight, best, worst)


def _expr(r: SpecReader, key: str, src: Any) -> expr.Expr:
    if not isinstance(src, str):
        raise r.error(key, "must be an expression string")
    try:
        return expr.parse(src)
    except expr.ExprError as e:
        raise r.error(key, str(e)) from None


def _param(r: SpecReader, name: str, raw: Any) -> Param:
    key = f"params.{name}"
    t = r.table(raw, key, {"type", "low", "high", "step", "log", "choices", "when", "constant", "flag", "env"})
    kind = r.choice(t, f"{key}.type", ("float", "int", "categorical"))
    when = _expr(r, f"{key}.when", t["when"]) if "when" in t else None
    if kind == "categorical":
        for k in ("low", "high", "step", "log"):
            if k in t:
                raise r.error(f"{key}.{k}", "not allowed for a categorical parameter")
        choices = t.get("choices")
        if not isinstance(choices, list) or not choices:
            raise r.error(f"{key}.choices", "must be a non-empty list")
        if any(not isinstance(c, (str, int, float, bool)) for c in choices):
            raise r.error(f"{key}.choices", "choices must be strings, numbers or booleans")
        if len({(type(c), c) for c in choices}) != len(choices):
            raise r.error(f"{key}.choices", "duplicate choice")
        return Param(name, kind, choices=tuple(choices), when=when)
    if "choices" in t:
        raise r.error(f"{key}.choices", f"not allowed for a {kind} parameter")
    log = t.get("log", False)
    if not isinstance(log, bool):
        raise r.error(f"{key}.log", "must be true or false")
    if kind == "int":
        low, high = r.integer(t, f"{key}.low"), r.integer(t, f"{key}.high")
        step = r.integer(t, f"{key}.step", low=1, default=1)
    else:
        low, high = r.number(t, f"{key}.low"), r.number(t, f"{key}.high")
        step = r.number(t, f"{key}.step", low=0, strict=True, default=None)
    if low > high:
        raise r.error(f"{key}.high", f"empty range: low {low} > high {high}")
    if log and low <= 0:
        raise r.error(f"{key}.low", f"log scale needs low > 0, got {low}")
    if log and step not in (None, 1):
        raise r.error(f"{key}.step", "a step cannot be combined with log scale")
    if step is not None and kind == "float":
        n = (high - low) / step
        if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
            raise r.error(f"{key}.step", f"high - low ({high - low:g}) must be a multiple of step {step:g}")
    if kind == "int" and (high - low) % step:
        raise r.error(f"{key}.step", f"high - low ({high - low}) must be a multiple of step {step}")
    return Param(name, kind, low=low, high=high, step=step, log=log, when=when)


def _check_satisfiable(r: SpecReader, space: SearchSpace) -> None:
    """Sample random points: an expression that cannot evaluate or constraints no point meets are errors."""
    rng = random.Random(0)
    violated: dict[str, int] = {}
    for _ in range(_CONSTRAINT_SAMPLES):
        try:
            point = space.sample(rng)
            _, broken = space.complete(point)
        except SpaceError as e:
            raise r.error(e.key, e.message) from None
        if broken is None:
            return
        violated[broken] = violated.get(broken, 0) + 1
    if not space.constraints:  # pragma: no cover - a point always passes without constraints
        return
    worst = max(violated, key=lambda k: violated[k])
    raise r.error(f"constraints.{worst}",
                  f"no point among {_CONSTRAINT_SAMPLES} random samples satisfies the constraints "
                  f"({worst!r} failed {violated[worst]} times)")
