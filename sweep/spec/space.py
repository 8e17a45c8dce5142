"""The search space: suggesting a trial's parameters, derived values and constraints.

Constraint policy: a point that violates a constraint is never trained. The driver tells that
trial FAIL with ``fail_kind = "constraint"`` and the violated constraint as ``fail_reason``, does
not count it towards ``n_trials`` and asks again (Optuna cannot re-suggest inside one trial).
After many rejections in a row the driver enqueues a random feasible point, so a sampler stuck in
an infeasible region cannot stall the sweep.

Names in ``[derived]`` that start with ``_`` are private to the spec (helpers for constraints such
as a parameter estimate); the others are passed to the trainer with the sampled parameters.

Optuna is imported only where a distribution is built, so loading a spec stays cheap for the CLI.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sweep.spec import expr


class SpaceError(ValueError):
    """A space that cannot be built or a parameter dict that does not fit it; ``key`` names the culprit."""

    def __init__(self, key: str, message: str) -> None:
        # Names come from specs and --params JSON: escape line breaks so the message stays one line.
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in f"{key}: {message}"))
        self.key = key
        self.message = message


class ConstraintViolation(Exception):
    """A suggested point breaks the named constraint; the trial must not run."""

    def __init__(self, name: str, source: str, params: Mapping[str, Any]) -> None:
        super().__init__(f"constraint {name!r} ({source}) violated")
        self.name = name
        self.source = source
        self.params = dict(params)


@dataclass(frozen=True)
class Param:
    """One searched parameter. ``when`` makes it conditional: it exists only where ``when`` is true."""

    name: str
    kind: str  # "float" | "int" | "categorical"
    low: Any = None
    high: Any = None
    step: Any = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    when: expr.Expr | None = None

    def distribution(self) -> Any:
        """The Optuna distribution, for ``suggest`` and for recording ad-hoc trials."""
        from optuna import distributions as d

        if self.kind == "categorical":
            return d.CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return d.IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return d.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def sample(self, rng: random.Random) -> Any:
        """A uniform (log-uniform where ``log``) random value, independent of Optuna."""
        if self.kind == "categorical":
            return rng.choice(self.choices)
        if self.kind == "int":
            if self.log:
                return min(self.high, max(self.low, round(math.exp(rng.uniform(math.log(self.low),
                                                                                  math.log(self.high))))))
            return rng.randrange(self.low, self.high + 1, self.step or 1)
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        if self.step:
            return round(self.low + self.step * rng.randint(0, round((self.high - self.low) / self.step)), 12)
        return rng.uniform(self.low, self.high)

    def check(self, value: Any) -> str | None:
        """Why ``value`` is not a point of this parameter, or None when it is."""
        if self.kind == "categorical":
            return None if any(type(c) is type(value) and c == value for c in self.choices) else \
                f"{value!r} is not one of {list(self.choices)}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{value!r} is not a number"
        if self.kind == "int" and not (isinstance(value, int) or float(value).is_integer()):
            return f"{value!r} is not an integer"
        if not self.low <= value <= self.high:
            return f"{value!r} is outside [{self.low}, {self.high}]"
        if self.step:
            n = (value - self.low) / self.step
            if abs(n - round(n)) > 1e-8:
                return f"{value!r} is not on the grid {self.low} + k·{self.step}"
        return None


@dataclass(frozen=True)
class SearchSpace:
    """Parameters in dependency order, derived values, constraints and fixed trainer settings."""

    params: tuple[Param, ...]
    derived: tuple[tuple[str, expr.Expr], ...] = ()
    constraints: tuple[tuple[str, expr.Expr], ...] = ()
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, params: Sequence[Param], derived: Sequence[tuple[str, expr.Expr]] = (),
              constraints: Sequence[tuple[str, expr.Expr]] = (), fixed: Mapping[str, Any] | None = None
              ) -> SearchSpace:
        """Check names and references, order conditional params after the ones they depend on."""
        fixed = dict(fixed or {})
        names: dict[str, str] = {}
        for section, keys in (("fixed", list(fixed)), ("params", [p.name for p in params]),
                              ("derived", [n for n, _ in derived])):
            for k in keys:
                if not k.isidentifier():
                    raise SpaceError(f"{section}.{k}", "must be an identifier (letters, digits, _)")
                if k in names:
                    raise SpaceError(f"{section}.{k}", f"already defined in [{names[k]}]")
                if k in expr.FUNCTIONS:
                    raise SpaceError(f"{section}.{k}", "shadows a built-in function")
                names[k] = section
        param_names = {p.name for p in params}
        ordered: list[Param] = []
        pending = list(params)
        while pending:
            ready = [p for p in pending if p.when is None or
                     all(n not in param_names or n in {q.name for q in ordered} for n in p.when.names)]
            if not ready:
                raise SpaceError(f"params.{pending[0].name}.when", "conditions depend on each other in a cycle")
            ordered.extend(ready)
            pending = [p for p in pending if p not in ready]
        known = set(fixed) | param_names
        for p in params:
            if p.when is not None:
                for n in p.when.names - known:
                    raise SpaceError(f"params.{p.name}.when", f"unknown name {n!r}")
                if p.name in p.when.names:
                    raise SpaceError(f"params.{p.name}.when", "a parameter cannot depend on itself")
        for name, e in derived:
            for n in e.names - known:
                raise SpaceError(f"derived.{name}", f"unknown name {n!r} (derived values may use params, "
                                 "fixed values and derived values defined above)")
            known.add(name)
        for name, e in constraints:
            for n in e.names - known:
                raise SpaceError(f"constraints.{name}", f"unknown name {n!r}")
        return cls(tuple(ordered), tuple(derived), tuple(constraints), fixed)

    # -- producing points ---------------------------------------------------------------------

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Suggest every active parameter on an Optuna trial; raise ConstraintViolation if infeasible.

        Returns the sampled parameters only (what Optuna records); use :meth:`trainer_config` for
        the full dict the trainer receives.
        """
        env: dict[str, Any] = dict(self.fixed)
        point: dict[str, Any] = {}
        for p in self.params:
            if p.when is not None and not self._eval(f"params.{p.name}.when", p.when, env):
                continue
            point[p.name] = env[p.name] = p.suggest(trial)
        _, broken = self.complete(point)
        if broken is not None:
            raise ConstraintViolation(broken, dict(self.constraints)[broken].source, point)
        return point

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """A random point (no constraint check), for load-time checks and unsticking the sampler."""
        env: dict[str, Any] = dict(self.fixed)
        point: dict[str, Any] = {}
        for p in self.params:
            if p.when is not None and not self._eval(f"params.{p.name}.when", p.when, env):
                continue
            point[p.name] = env[p.name] = p.sample(rng)
        return point

    def sample_feasible(self, rng: random.Random, attempts: int = 10_000) -> dict[str, Any] | None:
        for _ in range(attempts):
            point = self.sample(rng)
            if self.complete(point)[1] is None:
                return point
        return None

    # -- checking points ----------------------------------------------------------------------

    def complete(self, point: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Fixed values, the point and derived values in one env; plus the first violated constraint."""
        env: dict[str, Any] = {**self.fixed, **point}
        for name, e in self.derived:
            env[name] = self._eval(f"derived.{name}", e, env)
        for name, e in self.constraints:
            if not self._eval(f"constraints.{name}", e, env):
                return env, name
        return env, None

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Check a hand-written parameter dict (``sweep trial --params``) against the space.

        Every active parameter must be present and on its grid, inactive conditional ones absent,
        no unknown names, and all constraints met. Ints given as 3.0 are normalised to 3.
        """
        by_name = {p.name: p for p in self.params}
        for k in params:
            if k not in by_name:
                where = "fixed" if k in self.fixed else "derived" if k in dict(self.derived) else None
                raise SpaceError(k, f"is {where}, not a searched parameter" if where else "unknown parameter")
        env: dict[str, Any] = dict(self.fixed)
        point: dict[str, Any] = {}
        for p in self.params:
            active = p.when is None or self._eval(f"params.{p.name}.when", p.when, env)
            if not active:
                if p.name in params:
                    raise SpaceError(p.name, f"only exists when {p.when.source}")  # type: ignore[union-attr]
                continue
            if p.name not in params:
                raise SpaceError(p.name, "missing")
            value = params[p.name]
            why = p.check(value)
            if why:
                raise SpaceError(p.name, why)
            if p.kind == "int":
                value = int(value)
            elif p.kind == "float":
                value = float(value)
            point[p.name] = env[p.name] = value
        _, broken = self.complete(point)
        if broken is not None:
            raise SpaceError(f"constraints.{broken}", f"violated: {dict(self.constraints)[broken].source}")
        return point

    def distributions(self, point: Mapping[str, Any]) -> dict[str, Any]:
        by_name = {p.name: p for p in self.params}
        return {k: by_name[k].distribution() for k in point}

    def trainer_config(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """The flat config the trainer gets: fixed, sampled and public derived values."""
        env, _ = self.complete(point)
        return {k: v for k, v in env.items() if not k.startswith("_")}

    @staticmethod
    def _eval(key: str, e: expr.Expr, env: Mapping[str, Any]) -> Any:
        try:
            return e(env)
        except expr.ExprError as err:
            raise SpaceError(key, str(err)) from None
