"""What a study will cost before it starts, and a refusal to start one that costs more than its cap.

The estimate is an upper bound per trial: every trial holds its chips for its whole deadline
(``budget_s + startup_allowance_s + eval_timeout_s``, after which the supervisor kills it), so

    chip-hours = n_trials x chips per trial x deadline / 3600
    dollars    = chip-hours x (instance price per hour / chips per instance) [+ the head node]

Pruned trials stop early, so real sweeps cost less; not counted: retries of crashed or lost trials
(at most one each), node boot and the autoscaler's idle timeout, storage and data transfer.

Chips per trial come from the spec: ``trial.chips`` where it says (phase 2: 16, a whole trn2.48xlarge),
else ``trial.resources.neuron_cores`` logical cores, and a Trainium2 chip has 8 physical NeuronCores
shown as 4 logical ones with ``NEURON_LOGICAL_NC_CONFIG=2`` (the default) or 8 with ``=1`` (read from
``trial.env``). Unless told, the instance is the smallest that holds one trial: trn2.3xlarge for one
chip, trn2.48xlarge beyond.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from infra.aws import BadInput, InfraError, call
from sweep.spec import SpecError, load

# On-demand Linux prices in USD per instance-hour. Source: the Amazon EC2 On-Demand pricing page
# (aws.amazon.com/ec2/pricing/on-demand), US East (Ohio), as publicly reported in 2025; prices
# differ by region and change: `--live-price` asks the AWS Price List API instead, and
# `--price-usd-per-hour` overrides both. trn2.48xlarge is taken at 16x the one-chip trn2.3xlarge
# rate, as reported at trn2.3xlarge's launch; check it before trusting a phase-2 budget to it.
PRICES_USD_PER_HOUR: dict[str, float] = {
    "trn2.3xlarge": 2.235,
    "trn2.48xlarge": 35.76,
    "m7i.xlarge": 0.2016,
    "m7i.2xlarge": 0.4032,
    "m7i.4xlarge": 0.8064,
}
PRICE_SOURCE = "built-in table (EC2 on-demand, us-east-2, 2025; verify with --live-price)"
CHIPS_PER_INSTANCE = {"trn2.3xlarge": 1, "trn2.48xlarge": 16}
PHYSICAL_CORES_PER_CHIP = 8
CAP_KEY = "cost_cap_usd"  # [study] cost_cap_usd = 500.0


class CostCapExceeded(BadInput):
    """The estimate is over the cap: starting the study would break its own budget (exit 2)."""


@dataclass(frozen=True)
class Estimate:
    study: str
    n_trials: int
    chips_per_trial: int
    trial_seconds: float
    chip_hours: float
    instance_type: str
    usd_per_instance_hour: float
    chips_per_instance: int
    price_source: str
    trials_usd: float
    head_type: str | None
    head_hours: float | None
    head_usd: float
    total_usd: float
    cap_usd: float | None
    cap_source: str | None

    @property
    def usd_per_chip_hour(self) -> float:
        return self.usd_per_instance_hour / self.chips_per_instance

    @property
    def over_cap(self) -> bool:
        return self.cap_usd is not None and self.total_usd > self.cap_usd

    def lines(self) -> list[str]:
        if not self.chips_per_trial:
            out = [f"study {self.study}: reserves no Trainium chips (CPU or GPU trials): 0 chip-hours"]
        else:
            out = [
                f"study {self.study}: {self.n_trials} trials x {self.chips_per_trial} chip(s) x "
                f"{self.trial_seconds:g} s (budget + start-up allowance + eval timeout) = "
                f"{self.chip_hours:.1f} chip-hours",
                f"price: {self.instance_type} ${self.usd_per_instance_hour:.4g}/h for {self.chips_per_instance} "
                f"chip(s) = ${self.usd_per_chip_hour:.4g} per chip-hour [{self.price_source}]",
                f"trials: ${self.trials_usd:,.2f} (upper bound: every trial runs to its deadline)",
            ]
        if self.head_hours is not None:
            out.append(f"head: {self.head_type} for {self.head_hours:.1f} h = ${self.head_usd:,.2f}")
        elif not self.chips_per_trial:
            pass  # a laptop or CPU run: no cluster head to price
        else:
            out.append("head: not counted (concurrency is \"auto\" without max_concurrency: pass --parallel N "
                       "to include it)")
        out.append(f"total: ${self.total_usd:,.2f}")
        if self.cap_usd is not None:
            verdict = "OVER" if self.over_cap else "within"
            out.append(f"cap: ${self.cap_usd:,.2f} ({self.cap_source}): {verdict}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "usd_per_chip_hour": self.usd_per_chip_hour, "over_cap": self.over_cap}


def chips_per_trial(spec: Any) -> int:
    """Whole Trainium2 chips one trial of ``spec`` holds (0 for CPU or GPU trials)."""
    if getattr(spec, "chips", 0):
        return int(spec.chips)
    cores = int(spec.resources.neuron_cores)
    if cores <= 0:
        return 0
    lnc_text = str(spec.env.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    if lnc_text not in ("1", "2"):
        raise BadInput(f"{spec.path}: trial.env.NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {lnc_text!r}")
    per_chip = PHYSICAL_CORES_PER_CHIP // int(lnc_text)
    return math.ceil(cores / per_chip)


def load_spec(name_or_path: str) -> Any:
    """A study spec through the sweep's own loader (errors become exit-2 one-liners)."""

    try:
        return load(name_or_path)
    except SpecError as e:
        raise BadInput(str(e)) from None


def instance_for(chips: int) -> str:
    """The smallest instance type that holds a trial of ``chips`` chips (one trial per node)."""
    return next((t for t, n in sorted(CHIPS_PER_INSTANCE.items(), key=lambda kv: kv[1]) if n >= chips),
                max(CHIPS_PER_INSTANCE, key=lambda t: CHIPS_PER_INSTANCE[t]))


def estimate(spec: Any, instance_type: str | None = None, price_usd_per_hour: float | None = None,
             price_source: str | None = None, parallel: int | None = None, head_type: str | None = "m7i.2xlarge",
             head_price_usd_per_hour: float | None = None, cap_usd: float | None = None) -> Estimate:
    """The study's cost estimate; ``cap_usd`` (else the spec's ``study.cost_cap_usd``) is compared, not enforced.

    ``instance_type`` None: the smallest that holds one trial (:func:`instance_for`)."""
    chips = chips_per_trial(spec)
    instance_type = instance_type or instance_for(chips)
    if instance_type not in CHIPS_PER_INSTANCE:
        raise BadInput(f"--instance-type {instance_type!r}: one of {', '.join(CHIPS_PER_INSTANCE)}")
    price = price_usd_per_hour if price_usd_per_hour is not None else PRICES_USD_PER_HOUR[instance_type]
    if not price > 0:
        raise BadInput(f"price for {instance_type} must be positive, got {price}")
    source = price_source or ("--price-usd-per-hour" if price_usd_per_hour is not None else PRICE_SOURCE)
    per_instance = CHIPS_PER_INSTANCE[instance_type]
    if chips > per_instance:
        raise BadInput(f"{spec.path}: a trial needs {chips} chips but {instance_type} has {per_instance}")
    trial_s = float(spec.deadline_s)
    chip_hours = spec.n_trials * chips * trial_s / 3600.0
    trials_usd = chip_hours * price / per_instance

    parallel = parallel if parallel is not None else spec.concurrency or spec.max_concurrency
    if parallel is not None and parallel < 1:
        raise BadInput(f"--parallel must be >= 1, got {parallel}")
    head_hours = head_usd = None
    if head_type and parallel and chips:  # no chips: a laptop or CPU cluster, nothing to price
        head_hours = math.ceil(spec.n_trials / parallel) * trial_s / 3600.0
        head_price = (head_price_usd_per_hour if head_price_usd_per_hour is not None
                      else PRICES_USD_PER_HOUR.get(head_type))
        if head_price is None:
            raise BadInput(f"no price for head type {head_type!r}: pass --head-price-usd-per-hour")
        head_usd = head_hours * head_price

    cap_source = None
    if cap_usd is not None:
        cap_source = "--cap-usd"
    elif getattr(spec, CAP_KEY, None) is not None:
        cap_usd, cap_source = float(getattr(spec, CAP_KEY)), f"study.{CAP_KEY}"
    if cap_usd is not None and cap_usd < 0:
        raise BadInput(f"cost cap must be >= 0, got {cap_usd}")
    total = trials_usd + (head_usd or 0.0)
    return Estimate(study=spec.name, n_trials=spec.n_trials, chips_per_trial=chips, trial_seconds=trial_s,
                    chip_hours=chip_hours, instance_type=instance_type, usd_per_instance_hour=price,
                    chips_per_instance=per_instance, price_source=source, trials_usd=trials_usd,
                    head_type=head_type if head_hours is not None else None, head_hours=head_hours,
                    head_usd=head_usd or 0.0, total_usd=total, cap_usd=cap_usd, cap_source=cap_source)


def enforce(est: Estimate) -> None:
    """Refuse a study whose estimate exceeds its cap, in one line."""
    if est.over_cap:
        raise CostCapExceeded(
            f"study {est.study}: estimated ${est.total_usd:,.2f} ({est.chip_hours:.1f} chip-hours at "
            f"${est.usd_per_chip_hour:.4g}/chip-hour) exceeds the cost cap ${est.cap_usd:,.2f} ({est.cap_source}); "
            "lower n_trials or the budget, or raise the cap")


def live_price(pricing: Any, instance_type: str, region_name: str) -> float:
    """The on-demand Linux price from the AWS Price List API (its endpoint lives in us-east-1)."""
    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
        ("instanceType", instance_type), ("regionCode", region_name), ("operatingSystem", "Linux"),
        ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]
    out = call(f"Price List {instance_type} in {region_name}", pricing.get_products, ServiceCode="AmazonEC2",
               Filters=filters, MaxResults=10)
    for item in out.get("PriceList", []):
        product = json.loads(item) if isinstance(item, str) else item
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dim in term.get("priceDimensions", {}).values():
                usd = float(dim.get("pricePerUnit", {}).get("USD", 0) or 0)
                if usd > 0:
                    return usd
    raise InfraError(f"Price List has no on-demand Linux price for {instance_type} in {region_name}")
