"""The driver's warm-first policy: among enqueued trials waiting to start, graphs already compiled go first.

A cold Neuron compile costs minutes of a trial's start-up allowance; a trial whose graph key
(:func:`sweep.neuron.graph.graph_key`) a finished trial or ``sweep precompile`` compiled already starts
in seconds. Optuna is imported where it is used, as in the driver, so importing this stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sweep import store as st
from sweep.neuron.cache import ATTR_GRAPH_CACHE
from sweep.neuron.graph import ATTR_GRAPH_KEY, ATTR_PRECOMPILED, graph_key

log = logging.getLogger("sweep.run.warm")


def pick_warm(keys: Sequence[str | None], warm: set[str]) -> int | None:
    """Index of the first queued trial whose graphs are compiled already; None when none is."""
    return next((i for i, k in enumerate(keys) if k is not None and k in warm), None)


class WarmPicker:
    """The driver's preference for warm trials: when several enqueued trials wait (retries, enqueued
    points, ad-hoc trials), start the first whose graph key is known compiled before the queue's head.

    Warm keys: those of finished trials that compiled or loaded their graphs (``graph_cache`` hit or
    miss) and those ``sweep precompile`` filled, re-read at most every ``refresh_s``. New points the
    sampler proposes are left alone: the preference never changes what is sampled, only the order of
    what already waits.
    """

    def __init__(self, spec: Any, refresh_s: float = 30.0) -> None:
        self.spec = spec
        self.refresh_s = refresh_s
        self._warm: set[str] = set()
        self._read_at = -math.inf

    def key_of(self, params: Mapping[str, Any] | None) -> str | None:
        if not params:
            return None
        try:
            return graph_key(self.spec.space.trainer_config(params), self.spec.ranks, self.spec.env)
        except Exception:  # partial enqueued points: no key, so never preferred
            return None

    def warm_keys(self, study: Any) -> set[str]:
        from optuna.trial import TrialState

        if time.monotonic() - self._read_at < self.refresh_s:
            return self._warm
        done = st.study_storage(study).get_all_trials(st.study_id(study), deepcopy=False,
                                             states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
        warm = {t.user_attrs[ATTR_GRAPH_KEY] for t in done
                if t.user_attrs.get(ATTR_GRAPH_CACHE) in ("hit", "miss") and ATTR_GRAPH_KEY in t.user_attrs}
        with contextlib.suppress(Exception):
            warm |= set(st.study_storage(study).get_study_user_attrs(st.study_id(study)).get(ATTR_PRECOMPILED, []))
        self._warm, self._read_at = warm, time.monotonic()
        return warm

    def claim(self, study: Any) -> Any | None:
        """A warm waiting trial moved to RUNNING, as ``study.ask`` would; None leaves the choice to ``ask``."""
        import optuna
        from optuna.trial import TrialState

        storage = st.study_storage(study)
        waiting = storage.get_all_trials(st.study_id(study), deepcopy=False, states=(TrialState.WAITING,))
        if len(waiting) < 2:
            return None
        keys = [self.key_of(t.system_attrs.get("fixed_params")) for t in waiting]
        i = pick_warm(keys, self.warm_keys(study))
        if not i:  # none warm, or the head of the queue is: ask() takes it anyway
            return None
        try:
            if not storage.set_trial_state_values(st.trial_id(waiting[i]), state=TrialState.RUNNING):
                return None
        except optuna.exceptions.UpdateFinishedTrialError:
            return None
        st.forget_cached_trials(study)
        log.info("trial %d: graphs compiled already (key %s); started before trial %d", waiting[i].number, keys[i],
                 waiting[0].number)
        return optuna.trial.Trial(study, st.trial_id(waiting[i]))

