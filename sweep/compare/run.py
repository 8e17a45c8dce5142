"""A comparison run: :class:`CompareDriver` launches its pairs on the cluster's nodes.

A pair is one seed on one node: its sides run there back to back, in an order drawn from the comparison's
name and the pair's number, while other pairs run on the other nodes at the same time. The driver, Ray
tasks, supervisor and store are ``sweep run``'s (:class:`CompareDriver` only chooses what to launch where);
the decision is :mod:`sweep.compare.decision`'s, read after every finished pair.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from sweep import store as st
from sweep.compare import report
from sweep.compare.pairs import ATTR_NODE_WANTED, Run, finished, open_stage, runs_by_pair, seeds_by_pair, verdicts
from sweep.compare.plan import BASE, Plan, side_of
from sweep.run.driver import PROGRESS_EVERY_S, Driver, SweepStopped
from sweep.spec.script import SEED_KEY
from sweep.spec.studyspec import PAIR, SIDE

# -- running it --------------------------------------------------------------------------------------

class CompareDriver(Driver):
    """``sweep run``'s driver, launching a comparison's pairs instead of sampling: one pair per node at a time,
    its sides back to back in a drawn order; a new pair only while some candidate is undecided."""

    def __init__(self, plan_: Plan, out: TextIO | None = None, poll_s: float = 1.0) -> None:
        super().__init__(plan_.spec, out=out, poll_s=poll_s, next_steps=False)
        self.plan = plan_
        self._node_of: dict[Any, str] = {}  # in-flight ref -> node id

    def nodes(self) -> list[str]:
        """Alive Ray nodes that can hold a trial, in a fixed order."""
        import ray

        need = self.spec.resources.ray_options()
        cpus = float(need.get("num_cpus", 1) or 0)
        out = []
        for n in ray.nodes():
            res = n.get("Resources", {})
            if n.get("Alive") and res.get("CPU", 0) >= cpus and all(
                    res.get(k, 0) >= v for k, v in (need.get("resources") or {}).items()):
                out.append(n["NodeID"])
        return sorted(out)

    def turn(self) -> bool:
        """Launch pairs' sides onto free nodes, wait a poll for results; False once nothing is left to run."""
        launch = self.check_ray()
        trials = self._settled(self.scan())
        if launch and not self._stop:
            self._launch_free(trials)
        if self.breaker.tripped and not self.inflight:
            raise SweepStopped(self._breaker_cause(), infra=False)
        if not self.inflight:
            trials = self._settled(self.scan(force=True))
            others = any(t.state.name == "RUNNING" for t in trials)  # a dead driver's, until found lost
            if not others and not self._work(trials, self.nodes(), 1):
                return False
        self.wait_some()
        return True

    def _work(self, trials: Sequence[Any], nodes: Sequence[str], free: int) -> list[tuple[dict[str, Any], str | None]]:
        """What to launch next, one per free node: waiting retries first, then a pair's missing side, then new pairs
        while a candidate is undecided. Each entry: (the trial's parameters, or {} for a waiting one; its node)."""
        by_pair, seeds = runs_by_pair(trials), seeds_by_pair(trials)
        pending = {p for p, sides in by_pair.items() if any(not finished(r) for r in sides.values())}
        out: list[tuple[dict[str, Any], str | None]] = []
        for t in trials:
            if t.state.name == "WAITING":  # a retry, or a side asked for before the last driver stopped
                p = int(t.params.get(PAIR, -1))
                node = next((r.node for r in by_pair.get(p, {}).values() if r.node and r.trial != t.number), None)
                out.append(({}, _full(node, nodes)))
        v = verdicts(self.plan, trials)
        open_ = {label: s for label, vv in v.items() if (s := open_stage(vv, self.plan.confirm))}
        for p in sorted(by_pair):  # a started pair's sides still to run, in its drawn order, on its node
            if p in pending:
                continue
            runs = by_pair[p]
            stage = "confirm" if side_of(BASE, "confirm") in runs else "screen"
            node = pair_node(runs, nodes)
            # A side run on a node that is gone is no control for the others: it runs again on the pair's node.
            missing = [s for s in self._sides(p, stage, open_, runs) if s not in runs or (
                node is not None and runs[s].node is not None and not node.startswith(runs[s].node))]
            if missing:
                out.append(({SIDE: missing[0], PAIR: p, SEED_KEY: seeds.get(p, self.plan.first_seed + p)}, node))
        stages = set(open_.values())
        cap = 2 * self.plan.max_pairs * (2 if self.plan.confirm else 1)
        p = max(by_pair, default=-1) + 1
        for _ in range(free):  # new pairs, one per free node, while a candidate is undecided
            if not stages or p >= cap:
                break
            order = self._sides(p, "screen" if "screen" in stages else "confirm", open_, {})
            out.append(({SIDE: order[0], PAIR: p, SEED_KEY: self.plan.first_seed + p}, None))
            p += 1
        return out

    def _sides(self, pair: int, stage: str, open_: Mapping[str, str], have: Mapping[str, Run]) -> list[str]:
        """The sides pair ``pair`` runs, in its drawn order: the base and every candidate still open at its
        stage (or already run in it)."""
        cands = [side_of(c, stage) for c in self.plan.candidates if open_.get(c) == stage or side_of(c, stage) in have]
        sides = [side_of(BASE, stage), *cands]
        random.Random(f"{self.spec.name}/{pair}").shuffle(sides)
        started = [s for s in sides if s in have]
        return started + [s for s in sides if s not in have]

    def _launch_free(self, trials: Sequence[Any]) -> None:
        nodes = self.nodes()
        busy = {self._node_of[r] for r in self.inflight if r in self._node_of}
        free = [n for n in nodes if n not in busy]
        if not free:
            return
        work = self._work(trials, nodes, len(free))
        taken: set[int] = set()
        for params, node in work:
            pair = params.get(PAIR)
            if pair in taken:
                continue
            if node in nodes and node not in free:
                continue  # its pair's node is busy: it waits for it
            if node is None or node not in nodes:  # a new pair, or its node is gone (the pair is then split)
                node = free[0]
            free.remove(node)
            taken.add(pair)
            self._launch(params, node)
            if not free:
                break

    def _launch(self, params: dict[str, Any], node: str) -> None:
        """Enqueue a side (none for a waiting trial), ask it and launch it pinned to ``node``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        study = self.study
        if params:
            st.retry(lambda: study.enqueue_trial(params, user_attrs={ATTR_NODE_WANTED: node}), url=self.url)
        trial = st.retry(lambda: study.ask(), what="ask", url=self.url)
        self.launch(trial, {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)})

    def submit(self, number: int, trial_id: int, params: dict[str, Any], user_attrs: dict[str, Any],
               placement: dict[str, Any] | None = None) -> Any:
        ref = super().submit(number, trial_id, params, user_attrs, placement)
        if placement is not None:  # the node its pair waits on until it ends
            self._node_of[ref] = placement["scheduling_strategy"].node_id
        return ref

    def finish(self, slot: Any, ref: Any) -> None:
        self._node_of.pop(ref, None)
        super().finish(slot, ref)

    def summarise(self, number: int, trial_id: int) -> None:
        """The comparison's note and figure on the dashboard, in place of a sweep's best-trials summary."""
        report.write_dashboard(self.study, report.report(self.plan, self.study))

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_EVERY_S:
            return
        self._last_progress = now
        for label, v in verdicts(self.plan, self._settled(self.study.get_trials(deepcopy=False))).items():
            last = v.get("confirm") or v["screen"]
            where = "" if last.mean is None else f": mean {last.mean:+.4f} in [{last.lower:+.4f}, {last.upper:+.4f}]"
            self.say(f"compare {label}: {last.pairs_used} usable pair(s){where}, {last.verdict}")

    def print_best(self) -> None:  # the comparison's report follows the run
        return None


def pair_node(runs: Mapping[str, Run], nodes: Sequence[str]) -> str | None:
    """The alive node a started pair runs on: that of its latest-started run still on an alive node; None when
    every node it ran on is gone (its sides then all run again on a new one)."""
    alive = [r for r in runs.values() if r.node and any(n.startswith(r.node) for n in nodes)]
    if not alive:
        return None
    latest = max(alive, key=lambda r: (r.started or 0.0, r.trial))
    return _full(latest.node, nodes)


def _full(node: str | None, nodes: Sequence[str]) -> str | None:
    """A pair's recorded (short) node id as a full one among the alive ``nodes`` (as recorded when it is gone)."""
    if node is None:
        return None
    return next((n for n in nodes if n.startswith(node)), node)


def local_cluster(nodes: int) -> Any:
    """A Ray cluster of ``nodes`` one-CPU nodes on this machine, owned by this process (``--local-nodes``)."""
    import socket

    import ray
    from ray.cluster_utils import Cluster

    with socket.socket() as s:  # Ray's default head port may be another server's (6379 is Redis's here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                          "gcs_server_port": port})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="trnsweep", log_to_driver=False)
    return cluster


def close_local_cluster(cluster: Any) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()
    current = Path("/tmp/ray/ray_current_cluster")  # never joined by a later ray.init() of this machine
    if current.exists() and current.read_text().strip() == cluster.address:
        current.unlink()
