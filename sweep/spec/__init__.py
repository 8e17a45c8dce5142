"""The study definition: one TOML spec file per study, validated strictly at load time.

The room holds the spec file (:mod:`~sweep.spec.files` reads it, :mod:`~sweep.spec.components` checks
its sampler and pruner, :mod:`~sweep.spec.studyspec` validates the rest into a :class:`StudySpec`),
the search space and its expressions (:mod:`~sweep.spec.space`, :mod:`~sweep.spec.expr`), what is
told to Optuna (:mod:`~sweep.spec.objective`), a trial's memory limit (:mod:`~sweep.spec.limits`) and
the learning-curve pruner (:mod:`~sweep.spec.pruners`). This package re-exports the spec API the rest
of the sweep uses, so ``from sweep.spec import load`` is the usual way in; the other modules are
imported by their full path.
"""

from sweep.spec.components import (
    PRUNERS,
    SAMPLERS,
    Component,
    build_pruner,
    build_sampler,
    exercise_components,
    read_pruner,
    read_sampler,
)
from sweep.spec.files import STUDIES_DIR, SpecError, SpecReader, read_spec_file, resolve_path, spec_hash
from sweep.spec.studyspec import Resources, StudySpec, load, parse

__all__ = [
    "PRUNERS",
    "SAMPLERS",
    "STUDIES_DIR",
    "Component",
    "Resources",
    "SpecError",
    "SpecReader",
    "StudySpec",
    "build_pruner",
    "build_sampler",
    "exercise_components",
    "load",
    "parse",
    "read_pruner",
    "read_sampler",
    "read_spec_file",
    "resolve_path",
    "spec_hash",
]
