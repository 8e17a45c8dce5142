"""Cost estimates from study specs, the cap that refuses a study, and the live-price parser (Stubber)."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import ANY, Stubber

from infra import cost
from infra.aws import BadInput
from infra.cli import main


def spec_file(tmp_path, name="s", n_trials=10, budget=1800, allowance=900, eval_timeout=1200, cores=4, lnc="2",
              concurrency='"auto"', extra=""):
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[study]
n_trials = {n_trials}
concurrency = {concurrency}
{extra}
[trial]
budget_s = {budget}
startup_allowance_s = {allowance}
eval_timeout_s = {eval_timeout}
ranks = 1
[trial.env]
NEURON_LOGICAL_NC_CONFIG = "{lnc}"
[trial.resources]
neuron_cores = {cores}
[params.matrix_lr]
type = "float"
low = 0.01
high = 0.1
""")
    return path


def test_phase1_like_spec(tmp_path):
    est = cost.estimate(cost.load_spec(str(spec_file(tmp_path))))
    assert est.chips_per_trial == 1 and est.trial_seconds == 3900
    assert est.chip_hours == pytest.approx(10 * 3900 / 3600)
    assert est.trials_usd == pytest.approx(est.chip_hours * cost.PRICES_USD_PER_HOUR["trn2.3xlarge"])
    assert est.head_hours is None and est.total_usd == est.trials_usd and est.cap_usd is None
    assert "head: not counted" in "\n".join(est.lines())


@pytest.mark.parametrize("cores, lnc, chips", [(4, "2", 1), (8, "2", 2), (8, "1", 1), (16, "1", 2), (1, "2", 1)])
def test_chips_follow_the_logical_core_config(tmp_path, cores, lnc, chips):
    spec = cost.load_spec(str(spec_file(tmp_path, cores=cores, lnc=lnc)))
    assert cost.chips_per_trial(spec) == chips


def test_48xlarge_price_per_chip_and_head_with_parallel(tmp_path):
    spec = cost.load_spec(str(spec_file(tmp_path, n_trials=32, cores=4, concurrency=16)))
    est = cost.estimate(spec, instance_type="trn2.48xlarge", price_usd_per_hour=32.0)
    assert est.usd_per_chip_hour == 2.0 and est.price_source == "--price-usd-per-hour"
    assert est.head_hours == pytest.approx(2 * 3900 / 3600)  # 32 trials, 16 at a time: two rounds
    assert est.head_usd == pytest.approx(est.head_hours * cost.PRICES_USD_PER_HOUR["m7i.2xlarge"])
    assert est.total_usd == pytest.approx(est.trials_usd + est.head_usd)


def test_auto_concurrency_prices_the_head_at_its_max(tmp_path):
    spec = cost.load_spec(str(spec_file(tmp_path, n_trials=10, extra="max_concurrency = 5")))
    est = cost.estimate(spec)
    assert est.head_hours == pytest.approx(2 * 3900 / 3600)  # 10 trials, at most 5 at a time: two rounds


def test_cap_from_cli_refuses_in_one_line(tmp_path):
    est = cost.estimate(cost.load_spec(str(spec_file(tmp_path))), cap_usd=10.0)
    assert est.over_cap
    with pytest.raises(cost.CostCapExceeded) as e:
        cost.enforce(est)
    assert e.value.code == 2 and "\n" not in str(e.value)
    assert "exceeds the cost cap $10.00 (--cap-usd)" in str(e.value)
    cost.enforce(cost.estimate(cost.load_spec(str(spec_file(tmp_path))), cap_usd=1000.0))


def test_cap_from_the_spec(tmp_path):
    """study.cost_cap_usd in the spec sets the cap; the CLI flag still wins."""
    spec = cost.load_spec(str(spec_file(tmp_path, extra="cost_cap_usd = 5.0")))
    est = cost.estimate(spec)
    assert est.cap_usd == 5.0 and est.cap_source == "study.cost_cap_usd" and est.over_cap
    assert cost.estimate(spec, cap_usd=500.0).cap_source == "--cap-usd"


def test_cpu_spec_costs_nothing(tmp_path):
    est = cost.estimate(cost.load_spec(str(spec_file(tmp_path, cores=0, concurrency=2))))
    assert est.chips_per_trial == 0 and est.total_usd == 0 and est.head_hours is None
    cost.enforce(cost.estimate(cost.load_spec(str(spec_file(tmp_path, cores=0))), cap_usd=0.0))


def test_bad_inputs(tmp_path):
    spec = cost.load_spec(str(spec_file(tmp_path, cores=32)))
    with pytest.raises(BadInput, match="needs 8 chips but trn2.3xlarge has 1"):
        cost.estimate(spec, instance_type="trn2.3xlarge")
    with pytest.raises(BadInput, match="one of"):
        cost.estimate(spec, instance_type="p5.48xlarge")
    with pytest.raises(BadInput, match="must be positive"):
        cost.estimate(cost.load_spec(str(spec_file(tmp_path))), price_usd_per_hour=0.0)
    with pytest.raises(BadInput, match="no such study spec"):
        cost.load_spec(str(tmp_path / "absent.toml"))
    with pytest.raises(BadInput, match="NEURON_LOGICAL_NC_CONFIG must be 1 or 2"):
        cost.chips_per_trial(cost.load_spec(str(spec_file(tmp_path, lnc="3"))))


def test_spec_cap_refuses_the_sweep_and_a_bad_cap_is_bad_input(tmp_path, capsys):
    over = str(spec_file(tmp_path, extra="cost_cap_usd = 5.0"))
    assert main(["cost", over, "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "study.cost_cap_usd" in err[0]
    with pytest.raises(BadInput, match="study.cost_cap_usd"):
        cost.load_spec(str(spec_file(tmp_path, name="neg", extra="cost_cap_usd = -1")))


def test_cli_exit_codes_and_json(tmp_path, capsys):
    path = str(spec_file(tmp_path))
    assert main(["cost", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chips_per_trial"] == 1 and data["over_cap"] is False
    assert main(["cost", path, "--cap-usd", "1", "--check"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("infra: study s: estimated $") and err.count("\n") == 1
    assert main(["cost", path, "--check"]) == 0 and capsys.readouterr().out == ""
    assert main(["cost", path, "--cap-usd", "-3"]) == 2
    assert main(["cost", "no-such-study"]) == 2


def test_shipped_specs_estimate(capsys):
    for name in ("demo", "phase1", "demo-phase2"):
        assert main(["cost", name]) == 0
    assert "reserves no Trainium chips" in capsys.readouterr().out


def test_phase2_is_priced_as_whole_trn2_48xlarge_servers(capsys):
    """trial.chips = 16: a trn2.48xlarge per trial, for budget + allowance + eval timeout (CORE included)."""
    for name, n_trials, seconds in (("phase2", 6, 14400 + 900 + 4800), ("phase2-short", 24, 1800 + 900 + 1800)):
        est = cost.estimate(cost.load_spec(name))
        assert est.instance_type == "trn2.48xlarge" and est.chips_per_trial == 16 and est.chips_per_instance == 16
        assert est.n_trials == n_trials and est.trial_seconds == seconds
        assert est.trials_usd == pytest.approx(n_trials * seconds / 3600 * cost.PRICES_USD_PER_HOUR["trn2.48xlarge"])
        assert not est.over_cap
        assert main(["cost", name, "--check"]) == 0
    assert main(["cost", "phase2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["instance_type"] == "trn2.48xlarge" and round(data["total_usd"]) == 1198
    assert main(["cost", "phase2", "--instance-type", "trn2.3xlarge"]) == 2  # 16 chips do not fit one
    assert "needs 16 chips but trn2.3xlarge has 1" in capsys.readouterr().err


def test_chips_decide_the_chips_and_the_instance(tmp_path):
    path = tmp_path / "k.toml"
    text = spec_file(tmp_path).read_text().replace("ranks = 1\n", "chips = 4\n")
    path.write_text(text.replace("neuron_cores = 4\n", ""))
    spec = cost.load_spec(str(path))
    assert cost.chips_per_trial(spec) == 4 and spec.resources.neuron_cores == 16
    assert cost.instance_for(1) == "trn2.3xlarge" and cost.instance_for(4) == "trn2.48xlarge"
    assert cost.estimate(spec).instance_type == "trn2.48xlarge"


def test_live_price_parses_the_price_list():
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    product = {"product": {"attributes": {"instanceType": "trn2.3xlarge"}}, "terms": {"OnDemand": {"T1": {
        "priceDimensions": {"D1": {"unit": "Hrs", "pricePerUnit": {"USD": "2.2350000000"}}}}}}}
    with Stubber(client) as stub:
        stub.add_response("get_products", {"PriceList": [json.dumps(product)], "FormatVersion": "aws_v1"},
                          {"ServiceCode": "AmazonEC2", "Filters": ANY, "MaxResults": 10})
        assert cost.live_price(client, "trn2.3xlarge", "us-east-2") == 2.235
        stub.add_response("get_products", {"PriceList": [], "FormatVersion": "aws_v1"})
        with pytest.raises(cost.InfraError, match="no on-demand Linux price"):
            cost.live_price(client, "trn2.3xlarge", "eu-north-1")
