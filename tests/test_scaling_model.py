"""benchmarks/scaling_model.py: its formulas are the package's byte functions, and its check
against the measured 4-rank runs is computed from the JSON files in benchmarks/results."""

import math
import sys
from pathlib import Path

import pytest

from onebit_optax import _collective

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scaling_model as sm  # noqa: E402

# Bandwidth terms alone: 1 byte/s on the NIC, no latency, an infinitely fast local link.
BYTES = sm.Net(alpha=0.0, nic=1.0, g=8, alpha_l=0.0, local=math.inf)


@pytest.mark.parametrize("n", [16, 64, 1024])
def test_bytes_are_the_package_formulas(n):
  d, s = sm.padded(340_000_000, n), 7
  assert d % (128 * n) == 0 and d >= 340_000_000
  flat = 8 * _collective.compressed_wire_bytes(d, n, s) * (n - 8) / (n - 1)
  assert sm.flat_comm(d, n, s, BYTES) == pytest.approx(flat)
  hier = 8 * _collective.compressed_wire_bytes(d // 8, n // 8, s)
  assert sm.hier_comm(d, n, s, BYTES) == pytest.approx(hier)
  hier_ring = 8 * _collective.allreduce_wire_bytes(d // 8, n // 8)
  assert sm.adam_comm(d, n, BYTES) == pytest.approx(
      min(hier_ring, _collective.allreduce_wire_bytes(d, n)))
  one_per_node = sm.Net(alpha=1e-5, nic=1e9, g=1)
  assert sm.adam_comm(d, n, one_per_node) == pytest.approx(
      2 * (n - 1) * 1e-5 + _collective.allreduce_wire_bytes(d, n) / 1e9)


def test_layout_of_the_measured_run_inverts_the_byte_functions():
  run = sm.load_json("comm_throughput_rates.json")["runs"][0]
  d, s = sm.run_layout(run)
  assert d % (128 * run["num_ranks"]) == 0 and d >= run["num_params"]
  wire = run["summary"]["onebit_compression"]["state_wire_bytes"]
  assert _collective.compressed_wire_bytes(d, run["num_ranks"], s) == wire


# Both kinds of rows within 15%: measured Adam -7% (1 Gbit/s) and -4% (100 Mbit/s), the
# compressed step +1% and -10% (rates run at f42d72c, calibrated by the --profile run at
# 0d1dae9). Before that recalibration the profile dated from 5dabd2a, when the compressed
# step's compute was 0.58 s where it is now 0.22 s, and the model missed by -22% and -20%.
TOLERANCE = {"adam": 0.15, "onebit_compression": 0.15}


def test_prediction_of_the_measured_runs():
  """Link-bound rows (100 Mbit/s, 1 Gbit/s) of the rates run: step time and throughput ratio
  within TOLERANCE. Not asserted: the 10 Gbit/s rows, where the CPU testbed's Adam is
  host-bound (-54%), and the rows of the --profile run, which calibrates the server's
  share f of the compressed step (in-sample)."""
  docs = {n: sm.load_json(n) for n in ("comm_throughput.json", "comm_throughput_rates.json")}
  f, _ = sm.server_fraction(docs["comm_throughput.json"])
  rows = sm.validate(docs, f)
  assert len(rows) == 3 * sum(len(d["runs"]) for d in docs.values() if d)
  assert all(math.isfinite(r["pred"]) and r["pred"] > 0 for r in rows)
  checked = [r for r in rows if r["file"] == "comm_throughput_rates.json"
             and r["rate"] in ("100mbit", "1gbit") and r["mode"] != "onebit_warmup"]
  assert len(checked) == 4
  for r in checked:
    assert abs(r["pred"] / r["meas"] - 1) < TOLERANCE[r["mode"]], r
    assert abs(r["ratio_pred"] / r["ratio_meas"] - 1) < TOLERANCE["onebit_compression"], r


def test_query_prints_one_line(capsys):
  sm.main(["--params", "340e6", "--gbit", "25", "--ranks", "64"])
  out = capsys.readouterr().out.strip().splitlines()
  assert len(out) == 1 and "64 ranks (8 nodes x 8)" in out[0] and "1-bit Adam" in out[0]


# The hierarchical 2 x 2 run with the node's rate calibrated from the run's own profile
# (scaling_model.local_rate): -29% at 0d1dae9's rerun. What the model still leaves out is
# the hierarchical exchange's own compute (the momenta flattened into the fast axis's
# buffer), which the flat runs' compute does not hold: the profile's compressed_mean over
# ('node', 'local') takes 0.58 s where its collectives take 0.36 s. With one TCP stream's
# loopback rate for the node (10x what gloo's collectives reach) the miss was -69%.
HIER_TOLERANCE = 0.35


def test_prediction_of_the_hierarchical_run():
  doc = sm.hier_measured()
  assert doc is not None, "benchmarks/results/comm_throughput_hier.json is missing"
  f, _ = sm.server_fraction(sm.load_json("comm_throughput.json"))
  (row,) = sm.validate_hier(doc, f, 2e9)
  run = doc["runs"][0]
  assert row["local_Bps"] == sm.local_rate(run, run["ranks_per_node"])
  assert row["local_Bps"] < run["local_bandwidth_Bps"] / 5  # gloo, not one TCP stream
  assert abs(row["pred"] / row["meas"] - 1) < HIER_TOLERANCE, row
