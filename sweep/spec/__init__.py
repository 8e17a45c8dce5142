"""The study definition: one TOML spec file per study, validated strictly at load time.

The room holds the spec file itself (:mod:`sweep.spec.studyspec`), the search space and its expressions
(:mod:`~sweep.spec.space`, :mod:`~sweep.spec.expr`), what is told to Optuna
(:mod:`~sweep.spec.objective`), a trial's memory limit (:mod:`~sweep.spec.limits`) and the
learning-curve pruner (:mod:`~sweep.spec.pruners`). This package re-exports the spec API the rest of
the sweep uses, so ``from sweep.spec import load`` is the usual way in; the other modules are imported
by their full path.
"""

from sweep.spec.studyspec import (
    PRUNERS,
    SAMPLERS,
    STUDIES_DIR,
    Component,
    Resources,
    SpecError,
    StudySpec,
    build_pruner,
    build_sampler,
    load,
    parse,
    resolve_path,
)

__all__ = [
    "PRUNERS",
    "SAMPLERS",
    "STUDIES_DIR",
    "Component",
    "Resources",
    "SpecError",
    "StudySpec",
    "build_pruner",
    "build_sampler",
    "load",
    "parse",
    "resolve_path",
]
