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
        cost.estimate(spec)
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
    for name in ("demo", "phase1"):
        assert main(["cost", name]) == 0
    assert "reserves no Trainium chips" in capsys.readouterr().out


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
