"""Launch shape of a Neuron trial: ranks, logical-core config (LNC), compiler flags and NeuronCores.

``lnc`` (``NEURON_LOGICAL_NC_CONFIG``: 2 gives 4 logical cores per Trainium2 chip, 1 gives 8), ``ranks``
(torchrun processes, one logical core each) and ``neuron_cc_flags`` (``NEURON_CC_FLAGS``) are study
parameters like any other (fixed, searched or derived) but the trainer does not know them. Ray reserves
``neuron_cores`` counted in the node's logical-core config (what ``ray start`` saw in
``NEURON_LOGICAL_NC_CONFIG``, 2 unless the cluster says otherwise) and sets ``NEURON_RT_VISIBLE_CORES``
("0-3", "4,5,6,7", "0-1,4-5"). Those cores are translated into the trial's own LNC (a LNC-2 core is the
physical pair 2c, 2c+1) and split evenly over the ranks (rank r drives the first core of its share).
TorchNeuron wants exactly one core visible to each process of a distributed run (it sets
``NEURON_RT_VISIBLE_CORES`` to the local rank only where it is unset), so a multi-rank trial hands each
torchrun rank its own core: the list goes in ``TRNSWEEP_RANK_CORES`` and :mod:`sweep.neuron.rank`, which
torchrun starts in every rank, narrows ``NEURON_RT_VISIBLE_CORES`` to ``LOCAL_RANK``'s entry before
anything imports torch (:func:`rank_env`). A
plan that does not fit (3 ranks on 4 cores, a LNC-2 trial on cores that split physical pairs) is refused
with one line. A multi-chip trial (``trial.chips = K``, :func:`chip_cores`) is the same plan over K chips'
cores: one rank per logical core.
"""

from __future__ import annotations

import os
import random
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Study parameters the worker takes out of the trainer config. neuron_opt_level is TorchNeuron's own opt level
# (NEURON_COMPILER_OPT_LEVEL), which it passes before NEURON_CC_FLAGS on neuronx-cc's command line (docs/neuron.md).
LAUNCH_KEYS = ("lnc", "ranks", "neuron_cc_flags", "neuron_opt_level")
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"
CORES_VAR = "NEURON_RT_VISIBLE_CORES"  # set by Ray for a task holding neuron_cores
RANK_CORES_VAR = "TRNSWEEP_RANK_CORES"  # each torchrun rank's core, in local-rank order ("4,5,6,7")
RANK_MODULE = "sweep.neuron.rank"  # what torchrun runs in each rank when RANK_CORES_VAR is set
CC_FLAGS_VAR = "NEURON_CC_FLAGS"
OPT_LEVEL_VAR = "NEURON_COMPILER_OPT_LEVEL"
OPT_LEVELS = ("-O1", "-O2", "-O3")
# neuronx-cc's spellings of its LNC option (compiler CLI reference; NCC_EVRF066 and NCC_EARG001 use --lnc):
# refused in neuron_cc_flags, since a compiler LNC that differs from NEURON_LOGICAL_NC_CONFIG breaks kernels.
LNC_FLAGS = ("--lnc", "-lnc", "--logical-nc-config")
DEFAULT_NODE_LNC = 2  # Trainium2's default, and render-cluster's
LNC_VALUES = (1, 2)
CORES_PER_CHIP = 8  # physical NeuronCores of a Trainium2 chip
MAX_CHIPS = 16  # a trn2.48xlarge: a trial runs on one node


class LaunchError(ValueError):
    """A launch plan that cannot run here; the message is one line, ``key`` the launch key at fault."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


_CORE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cores(text: str) -> list[int]:
    """``NEURON_RT_VISIBLE_CORES`` in any of Ray's and the runtime's forms ("0-3", "4,5,6,7", "0-1,4-5")."""
    cores: list[int] = []
    for item in (s.strip() for s in text.split(",")):
        m = _CORE_ITEM.match(item)
        if not m:
            raise LaunchError(f"{CORES_VAR}={text!r}: {item!r} is not a core or a range a-b")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise LaunchError(f"{CORES_VAR}={text!r}: range {item} runs backwards")
        cores.extend(range(lo, hi + 1))
    if len(set(cores)) != len(cores):
        raise LaunchError(f"{CORES_VAR}={text!r}: a core is listed twice")
    return sorted(cores)


def format_cores(cores: Iterable[int]) -> str:
    """The shortest ranges form ("0-3,6"), which the runtime and Ray both read."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def to_trial_lnc(cores: Sequence[int], node_lnc: int, lnc: int) -> list[int]:
    """Cores counted in the node's LNC (what Ray hands out) renumbered in the trial's LNC.

    A LNC-2 core c is the physical pair (2c, 2c+1), so a LNC-1 trial on LNC-2 cores gets both halves,
    and a LNC-2 trial on LNC-1 cores needs whole, aligned pairs.
    """
    if node_lnc == lnc:
        return sorted(cores)
    if node_lnc == 2 and lnc == 1:
        return sorted(p for c in cores for p in (2 * c, 2 * c + 1))
    have = set(cores)
    pairs = sorted({c // 2 for c in have})
    split = [c for c in sorted(have) if c ^ 1 not in have]
    if split:
        raise LaunchError(f"{CORES_VAR}={format_cores(cores)} splits LNC-2 pairs (2k, 2k+1) at core(s) "
                          f"{format_cores(split)}: a LNC-2 trial needs whole pairs of LNC-1 cores")
    return pairs


def chip_cores(chips: int, lnc: int) -> int:
    """Logical NeuronCores of ``chips`` whole chips at ``lnc``: one torchrun rank each for a multi-chip trial."""
    return chips * CORES_PER_CHIP // lnc


def map_ranks(cores: Sequence[int], ranks: int, lnc: int) -> list[int]:
    """The core each rank drives: the cores split evenly, rank r taking the first of its share."""
    n = len(cores)
    if ranks < 1 or ranks > n or n % ranks:
        raise LaunchError(f"{ranks} rank(s) do not fit the {n} LNC-{lnc} NeuronCore(s) assigned "
                          f"({format_cores(cores)}): ranks must divide the core count")
    share = n // ranks
    return [cores[r * share] for r in range(ranks)]


def rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """This rank's ``NEURON_RT_VISIBLE_CORES`` (one core) from ``TRNSWEEP_RANK_CORES`` and ``LOCAL_RANK``.

    Empty when the launch gave no per-rank list (a single-rank trial, or a run outside the sweep, where
    TorchNeuron's own default, core = local rank, applies).
    """
    listed = env.get(RANK_CORES_VAR, "").strip()
    if not listed:
        return {}
    try:
        cores = [int(c) for c in listed.split(",")]
        local_rank = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise LaunchError(f"{RANK_CORES_VAR}={listed!r} with LOCAL_RANK={env.get('LOCAL_RANK')!r}: "
                          "expected integers") from None
    if not 0 <= local_rank < len(cores):
        raise LaunchError(f"LOCAL_RANK={local_rank} has no core in {RANK_CORES_VAR}={listed!r} "
                          f"({len(cores)} rank(s) planned)")
    return {CORES_VAR: str(cores[local_rank])}


def launch_values(config: Mapping[str, Any], default_ranks: int = 1,
                  env: Mapping[str, str] | None = None) -> tuple[int, int | None, str | None]:
    """(ranks, lnc, compiler flags) of a trial: its config first, then the spec's ``trial.ranks`` and env."""
    env = env or {}
    ranks = config.get("ranks", default_ranks)
    if isinstance(ranks, float) and ranks.is_integer():
        ranks = int(ranks)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise LaunchError(f"ranks must be a positive integer, got {ranks!r}", "ranks")
    lnc: Any = config.get("lnc", env.get(LNC_VAR))
    if lnc is not None:
        name = "lnc" if "lnc" in config else LNC_VAR
        try:
            lnc = int(lnc)
        except (TypeError, ValueError):
            raise LaunchError(f"{name} must be 1 or 2, got {lnc!r}", "lnc") from None
        if lnc not in LNC_VALUES:
            raise LaunchError(f"{name} must be 1 or 2, got {lnc!r}", "lnc")
    flags = config.get("neuron_cc_flags", env.get(CC_FLAGS_VAR))
    if flags is not None:
        if not isinstance(flags, str):
            raise LaunchError(f"neuron_cc_flags must be a string, got {flags!r}", "neuron_cc_flags")
        names = [t.split("=", 1)[0] for t in split_flags(flags)]
        if any(n in ("--cache_dir", "--cache-dir") for n in names):
            raise LaunchError("--cache_dir is set by the sweep (trial.compile_cache); remove it", "neuron_cc_flags")
        lnc_flag = next((n for n in names if n in LNC_FLAGS or n.startswith("--logical-nc")), None)
        if lnc_flag:
            raise LaunchError(f"{lnc_flag} in the compiler flags overrides the LNC that the kernels and the runtime "
                              "use (NCC_EVRF066); set the lnc parameter (NEURON_LOGICAL_NC_CONFIG) instead",
                              "neuron_cc_flags")
    return ranks, lnc, flags


def opt_level_value(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> str | None:
    """The trial's TorchNeuron opt level as the compiler takes it ("-O1".."-O3"): its config's
    ``neuron_opt_level`` (1, 2, 3 or "-O1".."-O3"), else the spec's ``trial.env``; None leaves TorchNeuron's own
    default (-O1 for eager ops, -O2 for torch.compile graphs)."""
    raw = config.get("neuron_opt_level", (env or {}).get(OPT_LEVEL_VAR))
    if raw is None or raw == "":
        return None
    text = str(raw).strip() if not isinstance(raw, bool) else ""
    if re.fullmatch(r"[123]", text):
        text = f"-O{text}"
    if text not in OPT_LEVELS:
        name = "neuron_opt_level" if "neuron_opt_level" in config else OPT_LEVEL_VAR
        raise LaunchError(f"{name} must be 1, 2 or 3 (or -O1, -O2, -O3), got {raw!r}", "neuron_opt_level")
    return text


def split_flags(flags: str) -> list[str]:
    """Compiler flags as tokens, the way a shell would split them (on whitespace where quoting is broken)."""
    try:
        return shlex.split(flags)
    except ValueError:
        return flags.split()


_SPEC_KEY = {"ranks": "trial.ranks", "lnc": f"trial.env.{LNC_VAR}", "neuron_cc_flags": f"trial.env.{CC_FLAGS_VAR}",
             "neuron_opt_level": f"trial.env.{OPT_LEVEL_VAR}"}


def spec_fit(neuron_cores: int, ranks: int, lnc: int | None) -> str | None:
    """Why a (ranks, lnc) plan cannot fit ``neuron_cores`` as the spec reserves them; None when it fits.

    ``neuron_cores`` counts cores at the cluster's LNC, assumed :data:`DEFAULT_NODE_LNC` here; the
    worker checks again against the cores Ray actually assigns.
    """
    if neuron_cores <= 0:
        return None
    lnc = lnc or DEFAULT_NODE_LNC
    logical = neuron_cores * DEFAULT_NODE_LNC // lnc
    if ranks > logical or logical % ranks:
        return (f"{ranks} rank(s) do not fit {logical} LNC-{lnc} NeuronCore(s) (trial.resources.neuron_cores = "
                f"{neuron_cores} at the cluster's LNC {DEFAULT_NODE_LNC}): ranks must divide the core count")
    return None


def check_spec(space: Any, neuron_cores: int, trial_ranks: int, trial_ranks_given: bool, env: Mapping[str, str],
               compile_cache: str) -> tuple[str, str] | None:
    """Launch settings a spec gets wrong, as (key, one-line message); None when all is well.

    Launch values are collected from the fixed values and from sampled points (conditional and
    derived ones included) and each (ranks, lnc) pair is checked against the reserved cores.
    """
    names = set(space.fixed) | {p.name for p in space.params} | {n for n, _ in space.derived}
    where = {**{k: "fixed" for k in space.fixed}, **{p.name: "params" for p in space.params},
             **{n: "derived" for n, _ in space.derived}}
    if "ranks" in names and trial_ranks_given:
        return "trial.ranks", f"ranks is also [{where['ranks']}] ranks; keep one"
    for key, var in (("lnc", LNC_VAR), ("neuron_cc_flags", CC_FLAGS_VAR), ("neuron_opt_level", OPT_LEVEL_VAR)):
        if key in names and var in env:
            return f"trial.env.{var}", f"the study sets [{where[key]}] {key}; keep one"
    if CORES_VAR in env:
        return f"trial.env.{CORES_VAR}", "Ray assigns the cores of a trial; use trial.resources.neuron_cores"
    if compile_cache and not (compile_cache.startswith("s3://") or os.path.isabs(compile_cache)):
        return "trial.compile_cache", f"must be an absolute path or s3://bucket/prefix, got {compile_cache!r}"
    try:  # trial.env's own LNC and compiler flags, which a study without launch keys never samples
        launch_values({}, 1, env)
        opt_level_value({}, env)
    except LaunchError as e:
        return _SPEC_KEY[e.key or "ranks"], str(e)
    if not names & set(LAUNCH_KEYS) and not neuron_cores:
        return None
    rng = random.Random(0)
    seen: set[tuple[Any, ...]] = set()
    for _ in range(200):
        try:
            env_point, broken = space.complete(space.sample(rng))
        except Exception:  # the spec's own checks report broken expressions
            return None
        if broken is not None:
            continue
        combo = tuple(env_point.get(k) for k in LAUNCH_KEYS)
        if combo in seen:
            continue
        seen.add(combo)
        try:
            ranks, lnc, _ = launch_values(env_point, trial_ranks, env)
            opt_level_value(env_point, env)
        except LaunchError as e:
            key = e.key or "ranks"
            return (f"{where[key]}.{key}" if key in where else _SPEC_KEY[key]), str(e)
        why = spec_fit(neuron_cores, ranks, lnc)
        if why:
            return (f"{where['ranks']}.ranks" if "ranks" in where else "trial.ranks"), why
    return None

