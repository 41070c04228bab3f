"""Predicted step throughput of Adam vs flat and hierarchical 1-bit Adam on real cluster shapes.

    .venv/bin/python benchmarks/scaling_model.py                       # validation + tables + plot
    .venv/bin/python benchmarks/scaling_model.py --params 1.3e9 --gbit 25 --ranks 256   # one line

Not a test and not a measurement: an alpha-beta model (seconds, no training),
calibrated by the measured 4-rank CPU runs in benchmarks/results/
(comm_throughput.json, comm_throughput_rates.json, optimizer_compute.md).

1. Validation: predicts the measured 4-rank runs (one rank per network
   namespace, so one rank per "node") from their own link goodput, round trip
   and compute-alone times, and prints predicted vs measured step time and
   throughput ratio with the relative error. A 2 namespaces x 2 ranks
   hierarchical run is predicted too when benchmarks/results/
   comm_throughput_hier.json exists ("not measured yet" otherwise).
2. Prediction for n = 8 ... 1024 ranks, ``g`` = 8 devices per node sharing one
   NIC, inter-node links 10/25/100 Gbit/s, intra-node 300 GB/s per device
   (NVLink-like: an assumption). Step time = compute + communication, no overlap:

     Adam (flat ring over all n ranks; the better of flat and hierarchical ring)
       t = t_fb + t_adam + 2(n-1) alpha + allreduce_wire_bytes(D, n) / B_nic
     flat 1-bit, compression phase (all_to_all + all_gather over n ranks)
       t = t_fb + t_adam + t_cmp(n) + 2(n-1) alpha
           + g * compressed_wire_bytes(D, n, S) * (n-g)/(n-1) / B_nic
     hierarchical 1-bit, axis_name=('node', 'local'), N = n/g nodes
       t = t_fb + t_adam + t_cmp(N) + [reduce-scatter f32 over g: (g-1) alpha_l + 4D (g-1)/g / B_l]
           + [2(N-1) alpha + g * compressed_wire_bytes(D/g, N, S) / B_nic]
           + [all_gather u8 over g: (g-1) alpha_l + (g-1)(D/(8g) + 4 S N) / B_l]
     1-bit warmup: Adam's all-reduce of the (unpadded, core v3) gradients with the warmup's
       compute
     whole run with warmup fraction w: t_run = w t_warmup + (1-w) t_compression

   with t_cmp(m) = c (1 - f + f/m): the compression's extra compute c at n = 1
   (worker + server on the whole vector), whose server part f shrinks with the
   chunk. Throughput ratio = t_adam / t_1bit (same batch per rank).

The GPU compute is an ASSUMPTION (no GPU table was measured): t_fb = 6 P T /
(peak * MFU), t_adam = 28 bytes/element / HBM bandwidth, and the 1-bit extra
compute keeps the ratio measured on CPU (optimizer_compute.md, largest size).
Writes benchmarks/results/scaling_model.md, scaling_model_summary.md (the README's
excerpt: python benchmarks/update_readme.py copies it) and scaling_model.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

from onebit_optax import _collective

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
GBITS = (10.0, 25.0, 100.0)
BLOCK = 128  # the layout pads to multiples of 128 n elements


@dataclasses.dataclass(frozen=True)
class Net:
  """Links: ``alpha`` s per inter-node message, ``nic`` bytes/s per node (shared by ``g`` devices)."""
  alpha: float
  nic: float
  g: int = 8
  alpha_l: float = 5e-6
  local: float = 300e9


@dataclasses.dataclass(frozen=True)
class Compute:
  """Seconds per step per rank: forward/backward + Adam update, and the 1-bit extras (at n = 1)."""
  base: float          # t_fb + t_adam
  compress: float      # c: compression step minus Adam step, one device (worker + whole server)
  warmup: float        # warmup step minus Adam step
  server_frac: float   # f: part of c that is the server's (scales with the chunk, 1/n)


def padded(params: int, n: int) -> int:
  """D: params rounded up to a multiple of 128 n (the optimizer's flat buffer, bar per-leaf padding)."""
  q = BLOCK * n
  return -(-int(params) // q) * q


def t_compress(c: Compute, m: int) -> float:
  """t_cmp(m) = c (1 - f + f/m): the server chunk is 1/m of the vector."""
  return c.compress * (1.0 - c.server_frac + c.server_frac / m)


def adam_comm(d: int, n: int, net: Net) -> float:
  """Ring all-reduce, the better of flat and hierarchical ring.

  flat: 2(n-1) alpha + allreduce_wire_bytes(D, n) / B (B = NIC if n > g: one ring edge leaves
  each node); hier: reduce-scatter + all-gather over g on the fast link, g rings over the N nodes
  of D/g each sharing the NIC: 2(N-1) alpha + g allreduce_wire_bytes(D/g, N) / B_nic.
  """
  g = min(net.g, n)
  if n <= g:
    return 2 * (n - 1) * net.alpha_l + _collective.allreduce_wire_bytes(d, n) / net.local
  flat = 2 * (n - 1) * net.alpha + _collective.allreduce_wire_bytes(d, n) / net.nic
  nodes = n // g
  local = 2 * (g - 1) * net.alpha_l + _collective.allreduce_wire_bytes(d, g) / net.local
  hier = local + 2 * (nodes - 1) * net.alpha + g * _collective.allreduce_wire_bytes(
      d // g, nodes) / net.nic
  return min(flat, hier)


def flat_comm(d: int, n: int, segments: int, net: Net) -> float:
  """all_to_all + all_gather over n ranks: 2(n-1) alpha + NIC bytes / B_nic + local bytes / B_l.

  Per rank b = compressed_wire_bytes(D, n, S) = 2(n-1)(D/(8n) + 4S); a fraction (n-g)/(n-1) of
  the peers is off-node and the g ranks of a node share the NIC: NIC bytes = g b (n-g)/(n-1).
  """
  g = min(net.g, n)
  b = _collective.compressed_wire_bytes(d, n, segments)
  nic = g * b * (n - g) / (n - 1) / net.nic
  local = b * (g - 1) / (n - 1) / net.local
  alpha = net.alpha if n > g else net.alpha_l
  return 2 * (n - 1) * alpha + nic + local


def hier_comm(d: int, n: int, segments: int, net: Net) -> float:
  """Reduce-scatter f32 over g, 1-bit mean of D/g over the N nodes, all_gather u8 over g.

  (g-1) alpha_l + 4D (g-1)/g / B_l  +  2(N-1) alpha + g compressed_wire_bytes(D/g, N, S) / B_nic
  + (g-1) alpha_l + (g-1)(D/(8g) + 4 S N) / B_l.
  """
  g = min(net.g, n)
  nodes = n // g
  rs = (g - 1) * net.alpha_l + _collective.allreduce_wire_bytes(d, g) / 2 / net.local
  mid = 0.0
  if nodes > 1:
    mid = 2 * (nodes - 1) * net.alpha + g * _collective.compressed_wire_bytes(
        d // g, nodes, segments) / net.nic
  ag = (g - 1) * net.alpha_l + (g - 1) * (d / (8 * g) + 4 * segments * nodes) / net.local
  return rs + mid + ag


def step_times(params: int, n: int, segments: int, net: Net, c: Compute) -> dict:
  """Seconds per step: adam, warmup, flat and hier compression (see the module docstring)."""
  d = padded(params, n)
  g = min(net.g, n)
  t_adam = c.base + adam_comm(params, n, net)
  return {"adam": t_adam,
          "warmup": c.base + c.warmup + adam_comm(params, n, net),  # core v3: the unpadded tree
          "flat": c.base + t_compress(c, n) + flat_comm(d, n, segments, net),
          "hier": c.base + t_compress(c, max(n // g, 1)) + hier_comm(d, n, segments, net)}


def ratios(t: dict, warmup_frac: float) -> dict:
  """Throughput vs Adam: t_adam / t for compression, and t_adam / (w t_warmup + (1-w) t) per run."""
  run = lambda k: warmup_frac * t["warmup"] + (1 - warmup_frac) * t[k]
  return {"x_flat": t["adam"] / t["flat"], "x_hier": t["adam"] / t["hier"],
          "x_flat_run": t["adam"] / run("flat"), "x_hier_run": t["adam"] / run("hier")}


# --- calibration from the measured runs ------------------------------------------------

def load_json(name: str):
  path = RESULTS / name
  return json.loads(path.read_text()) if path.exists() else None


def _profile_get(p: dict, prefix: str):
  return next((v for k, v in p.items() if k.startswith(prefix)), None)


def server_seconds(doc) -> float | None:
  """Core v3 profiles: the server of the whole vector on one rank (s at n = 1), else None."""
  for run in (doc or {}).get("runs", []):
    s1 = _profile_get(run.get("profile") or {}, "server alone, n=1")
    if s1 is not None:
      return s1
  return None


def server_fraction(doc) -> tuple[float, str]:
  """f, the server's part of the 1-bit extra compute at n = 1, from the profile.

  Core v3 profiles time the pieces alone: f = s_1 / (rows + s_1) (rows: building
  the messages of the whole tree; s_1: the server of the whole vector). Older
  profiles: t_cm(1) = w + s, t_cm(n) - t_a2a - t_ag = w + s/n  =>  s = ... n/(n-1).
  """
  for run in (doc or {}).get("runs", []):
    p, n = run.get("profile"), run["num_ranks"]
    if not p:
      continue
    s1, rows = _profile_get(p, "server alone, n=1"), _profile_get(p, "rows alone")
    if s1 is not None and rows is not None:
      f = min(max(s1 / (rows + s1), 0.0), 1.0)
      return f, (f"measured (profile of comm_throughput.json, {run['short_label']}: rows "
                 f"{rows:.3f} s, server of the whole vector {s1:.3f} s): f = {f:.2f}")
    t1 = p["compressed_mean, no communication (n=1)"]
    comm = p["all_to_all uint8 (phase 1)"] + p["all_gather uint8 (phase 2)"]
    s = (t1 - p["compressed_mean, n ranks"] + comm) * n / (n - 1)
    f = min(max(s / t1, 0.0), 1.0)
    return f, f"measured (profile of comm_throughput.json, {run['short_label']}): f = {f:.2f}"
  return 0.5, "ASSUMED f = 0.5 (no profile in comm_throughput.json)"


def cpu_compute(doc, f: float, server_s: float | None = None) -> Compute:
  """Compute-alone times of the 4 ranks (the run's own calibration).

  Core v3 runs (a ``wire_layout`` per run): a 1-device cluster has no server
  phase, so the compute-alone compression step holds only the worker's part;
  the server of the whole vector (``server_s``, the profile's, when known) is
  added to c, and f becomes its share: t_cmp(n) = worker + s_1 / n.
  """
  s = doc["compute"]["summary"]
  base = s["adam"]["step_s"]
  c = s["onebit_compression"]["step_s"] - base
  v3 = any("wire_layout" in run for run in doc.get("runs", []))
  if v3 and server_s:
    c, f = c + server_s, server_s / (c + server_s)
  return Compute(base, c, s["onebit_warmup"]["step_s"] - base, f)


def cpu_ratios(path: Path = RESULTS / "optimizer_compute.md") -> tuple[float, float, str]:
  """(compression/adam, warmup/adam) of the largest size in optimizer_compute.md."""
  rows = re.findall(r"^\| ([\d,]+) \| [\d.]+ \| [\d.]+ \| \**([\d.]+)\** \| [\d.]+ \| \**([\d.]+)\**",
                    path.read_text() if path.exists() else "", re.M)
  if not rows:
    return 6.0, 2.5, "ASSUMED (optimizer_compute.md not found)"
  size, warm, comp = max(rows, key=lambda r: int(r[0].replace(",", "")))
  return float(comp), float(warm), f"measured on CPU at {size} parameters (optimizer_compute.md)"


def link_calibration(docs) -> tuple[float, float]:
  """(alpha = mean measured round trip / 2, NIC efficiency = mean goodput / nominal tc rate)."""
  unit = {"mbit": 1e6, "gbit": 1e9}
  rtts, effs = [], []
  for doc in docs:
    for run in (doc or {}).get("runs", []):
      m = re.fullmatch(r"([\d.]+)(mbit|gbit)", run.get("short_label", ""))
      rtts.append(run["rtt_s"])
      if m:
        effs.append(run["bandwidth_Bps"] * 8 / (float(m[1]) * unit[m[2]]))
  if not rtts:
    return 12e-6, 0.95
  return sum(rtts) / len(rtts) / 2, (sum(effs) / len(effs) if effs else 0.95)


def run_layout(run) -> tuple[int, int]:
  """(D, S) of a measured run, from the optimizer's own wire bytes.

  Core v3 runs save their wire layout: D = the padded sign stream of the
  compressed leaves, and S (inverting compressed_wire_bytes(D, n, S) = 2(n-1)
  row_bytes) = scales + exact floats per message. Older runs: D inverts
  allreduce_wire_bytes(D, n) of the (padded) warmup.
  """
  n, s = run["num_ranks"], run["summary"]
  if "wire_layout" in run:
    d = int(run["wire_layout"]["padded"])
  else:
    d = round(s["onebit_warmup"]["state_wire_bytes"] / _collective.allreduce_wire_bytes(1, n))
  per_phase = s["onebit_compression"]["state_wire_bytes"] / (2 * (n - 1))
  return d, round((per_phase - d / (8 * n)) / 4)


def warmup_size(run) -> int:
  """Elements the warmup all-reduces: inverts allreduce_wire_bytes (v3: the unpadded tree)."""
  n = run["num_ranks"]
  return round(run["summary"]["onebit_warmup"]["state_wire_bytes"]
               / _collective.allreduce_wire_bytes(1, n))


def validate_run(run, c: Compute) -> list[dict]:
  """Predicted vs measured s/step of one 4-rank run (each rank its own namespace: g = 1)."""
  n, s = run["num_ranks"], run["summary"]
  d, segs = run_layout(run)
  net = Net(alpha=run["rtt_s"] / 2, nic=run["bandwidth_Bps"], g=1)
  t = step_times(run["num_params"], n, segs, net, c)
  t["warmup"] = c.base + c.warmup + adam_comm(warmup_size(run), n, net)
  compute = {"adam": c.base, "warmup": c.base + c.warmup, "flat": c.base + t_compress(c, n)}
  rows = []
  for mode, key in (("adam", "adam"), ("onebit_warmup", "warmup"), ("onebit_compression", "flat")):
    meas = s[mode]["step_s"]
    rows.append({"rate": run["short_label"], "mode": mode, "pred": t[key], "meas": meas,
                 "ratio_pred": t["adam"] / t[key], "ratio_meas": s["adam"]["step_s"] / meas,
                 "comm_pred": t[key] - compute[key], "comm_implied": meas - compute[key]})
  return rows


def validate(docs, f: float, server_s: float | None = None) -> list[dict]:
  """All measured 4-rank runs of comm_throughput.json and comm_throughput_rates.json.

  ``server_s``: the server of the whole vector on one rank (core v3 runs; default:
  from the profile of comm_throughput.json).
  """
  if server_s is None:
    server_s = server_seconds(docs.get("comm_throughput.json"))
  rows = []
  for name, doc in docs.items():
    if doc is None:
      continue
    c = cpu_compute(doc, f, server_s)
    for run in doc["runs"]:
      for r in validate_run(run, c):
        rows.append({"file": name, **r})
  return rows


def hier_measured():
  """The 2 namespaces x 2 ranks hierarchical measurement, if comm_throughput.py has written one."""
  doc = load_json("comm_throughput_hier.json")
  if doc is not None:
    return doc
  for name in ("comm_throughput.json", "comm_throughput_rates.json"):
    for run in (load_json(name) or {}).get("runs", []):
      if "hier" in run.get("label", "") or any("hier" in k for k in run.get("summary", {})):
        return {"runs": [run], "compute": load_json(name).get("compute")}
  return None


_LOCAL_REDUCTION = "psum f32 over 'local' (padded buffer)"


def local_rate(run, g: int) -> float | None:
  """The testbed's effective rate inside a node, from the run's profile (None without one).

  Over gloo the hierarchical exchange reduces over the node with a float32
  all-reduce and a slice (``onebit_optax._collective._fast_mean_slice``):
  gloo's reduce-scatter was slower still. The rate returned makes the
  model's reduce-scatter term take the measured time of that all-reduce, so
  the check tests the rest of the model on what the code runs. (One TCP
  stream over the same loopback, the run's ``local_bandwidth_Bps``, is 10x
  faster than what gloo's collectives reach.)
  """
  t = (run.get("profile") or {}).get(_LOCAL_REDUCTION)
  if not t:
    return None
  d = padded(run["num_params"], run["num_ranks"])
  return _collective.allreduce_wire_bytes(d, g) / 2 / t


def _hier_net(run, local_Bps: float) -> Net:
  """Links of a measured hierarchical run: shaped node links; inside a node :func:`local_rate`."""
  g = int(run.get("ranks_per_node") or run["num_ranks"] // int(run.get("num_nodes", 2)))
  local = local_rate(run, g) or next(
      (v for k, v in run.items() if "local" in k and k.endswith("Bps")), local_Bps)
  return Net(alpha=run["rtt_s"] / 2, nic=run["bandwidth_Bps"], g=g, alpha_l=run["rtt_s"] / 2,
             local=local)


def validate_hier(doc, f: float, local_Bps: float) -> list[dict]:
  """Predict the hierarchical runs (flat-model compute; g = ranks per namespace)."""
  rows = []
  for run in doc.get("runs", []):
    s, n = run["summary"], run["num_ranks"]
    key = next(k for k in s if "hier" in k)
    c = cpu_compute(doc if "onebit_compression" in doc.get("compute", {}).get("summary", {})
                    else load_json("comm_throughput_rates.json"), f)
    net = _hier_net(run, local_Bps)
    t = step_times(run["num_params"], n, 4, net, c)
    rows.append({"rate": run.get("short_label", "?"), "mode": key, "pred": t["hier"],
                 "meas": s[key]["step_s"], "ratio_pred": t["adam"] / t["hier"],
                 "ratio_meas": s["adam"]["step_s"] / s[key]["step_s"],
                 "local_Bps": net.local})
  return rows


# --- the cluster prediction ---------------------------------------------------------------

def gpu_compute(params: float, a, f: float, r_comp: float, r_warm: float) -> Compute:
  """ASSUMED GPU compute: t_fb = 6 P T / (peak MFU), t_adam = 28 P / HBM (p,g,m,v read; p,m,v
  written, f32), 1-bit extras = (measured CPU ratio - 1) t_adam."""
  t_fb = 6 * params * a.tokens_per_gpu / (a.gpu_tflops * 1e12 * a.mfu)
  t_upd = 28 * params / (a.hbm_gbps * 1e9)
  return Compute(t_fb + t_upd, (r_comp - 1) * t_upd, (r_warm - 1) * t_upd, f)


def predict_table(params: float, a, cal) -> list[dict]:
  """Rows (gbit, n) with the step times and the throughput ratios."""
  c = gpu_compute(params, a, cal["f"], cal["r_comp"], cal["r_warm"])
  rows = []
  for gbit in a.gbit_list:
    net = Net(alpha=cal["alpha"], nic=gbit * 1e9 / 8 * cal["eff"] * a.nics_per_node, g=a.per_node,
              alpha_l=a.alpha_local_us * 1e-6, local=a.local_gbps * 1e9)
    for n in a.rank_list:
      t = step_times(int(params), n, a.segments, net, c)
      rows.append({"params": params, "gbit": gbit, "n": n, **t, **ratios(t, a.warmup_frac)})
  return rows


def verdict(r: dict) -> str:
  best = "hierarchical" if r["x_hier_run"] >= r["x_flat_run"] else "flat"
  pays = max(r["x_hier_run"], r["x_flat_run"]) > 1.0
  return f"1-bit Adam {'pays' if pays else 'does not pay'} (best: {best})"


def query_line(r: dict, a) -> str:
  """One line for ``--params P --gbit G --ranks n``."""
  return (f"{r['params'] / 1e6:,.0f}M params, {r['n']} ranks ({max(r['n'] // a.per_node, 1)} nodes "
          f"x {a.per_node}), {r['gbit']:g} Gbit/s: Adam {r['adam'] * 1e3:.0f} ms/step; compression "
          f"phase flat {r['x_flat']:.2f}x, hier {r['x_hier']:.2f}x Adam's throughput; whole run "
          f"({a.warmup_frac:.0%} warmup) flat {r['x_flat_run']:.2f}x, hier {r['x_hier_run']:.2f}x: "
          f"{verdict(r)}")


# --- output ---------------------------------------------------------------------------------

def validation_md(rows: list[dict], hier_rows) -> list[str]:
  out = ["| file | link | step | predicted s/step | measured s/step | error | x Adam predicted "
         "| x Adam measured | error |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows + (hier_rows or []):
    e1, e2 = r["pred"] / r["meas"] - 1, r["ratio_pred"] / r["ratio_meas"] - 1
    out.append(f"| {r.get('file', 'comm_throughput_hier')} | {r['rate']} | {r['mode']} | "
               f"{r['pred']:.3f} | {r['meas']:.3f} | {e1:+.0%} | {r['ratio_pred']:.2f} | "
               f"{r['ratio_meas']:.2f} | {e2:+.0%} |")
  out += ["", "Communication implied by the measurement (measured - modelled compute) vs modelled:"]
  out += [f"- {r['rate']} {r['mode']}: {r['comm_implied']:.3f} s vs {r['comm_pred']:.3f} s"
          for r in rows if r.get("file") == "comm_throughput_rates.json"]
  out += [f"- hierarchical, {r['rate']}: inside a node {r['local_Bps'] / 1e6:,.0f} MB/s "
          "(calibrated: the model's reduce-scatter over the node takes the measured time of the "
          "float32 all-reduce over 'local' that gloo runs instead; `local_rate`)"
          for r in hier_rows or []]
  if hier_rows is None:
    out += ["", "Hierarchical 2 namespaces x 2 ranks: not measured yet "
            "(no readable benchmarks/results/comm_throughput_hier.json or hierarchical entry)."]
  return out


def table_md(rows: list[dict]) -> list[str]:
  out = ["| params | inter-node | ranks | nodes | Adam s/step | flat 1-bit x Adam | flat, whole run "
         "| hier 1-bit x Adam | hier, whole run | verdict |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    out.append(f"| {r['params'] / 1e6:,.0f}M | {r['gbit']:g} Gbit/s | {r['n']} | {r['n'] // 8} | "
               f"{r['adam']:.3f} | {r['x_flat']:.2f} | {r['x_flat_run']:.2f} | {r['x_hier']:.2f} "
               f"| {r['x_hier_run']:.2f} | {verdict(r)} |")
  return out


def assumptions_md(a, cal) -> list[str]:
  return [
      f"- Links: {a.per_node} devices per node share {a.nics_per_node} NIC(s) (the NIC is the "
      f"shared bottleneck of every inter-node byte); NIC goodput = nominal x {cal['eff']:.3f} "
      f"(mean goodput/tc rate measured on the veth links); alpha = {cal['alpha'] * 1e6:.1f} us per "
      f"inter-node message (mean measured round trip / 2; messages: ring all-reduce 2(n-1), "
      f"all_to_all n-1, all_gather n-1, sent one after the other). ASSUMED intra-node: "
      f"{a.local_gbps:g} GB/s per device (NVLink-like), alpha_local = {a.alpha_local_us:g} us.",
      "- Adam: ring all-reduce of the f32 gradients, the better of a flat ring (2(n-1) alpha, "
      "one ring edge per node on the NIC) and a hierarchical ring (local reduce-scatter, g rings "
      "of D/g over the nodes sharing the NIC, local all-gather). No overlap of communication with "
      "the backward pass for any optimizer (favours none; real Adam overlaps buckets, so its "
      "ratios here are an upper bound for 1-bit Adam).",
      f"- ASSUMED GPU compute (no GPU was available, no GPU table exists): forward+backward "
      f"= 6 P T / (peak x MFU) with T = {a.tokens_per_gpu} tokens per GPU per step, peak "
      f"{a.gpu_tflops:g} TFLOP/s, MFU {a.mfu:g}; Adam update = 28 bytes/parameter / "
      f"{a.hbm_gbps:g} GB/s HBM; 1-bit compression step = {cal['r_comp']:.2f} x and warmup step "
      f"= {cal['r_warm']:.2f} x the Adam update ({cal['r_src']}; the GPU is assumed to keep the "
      f"CPU's ratio).",
      f"- Compression compute: t_cmp(m) = c (1 - f + f/m), server part {cal['f_src']}. "
      "Hierarchical: the same worker cost as flat (an upper bound: its worker compresses only "
      "the D/8 slice) and the server part over N = n/8 nodes.",
      f"- S = {a.segments} scales per chunk (4S bytes; negligible next to D/(8n)); D = params "
      f"rounded up to 128 n. Whole run: warmup fraction w = {a.warmup_frac:g} of the steps "
      "(e.g. the freeze at 15% of the run), warmup step = Adam's all-reduce + the warmup compute.",
  ]


def summary_md(val: list[dict], hier, rows: list[dict], a) -> list[str]:
  """The short excerpt for the README: the check per measured run, one model size's ratios."""
  out = ["Check against the measured 4-rank runs: predicted/measured - 1 of the step time "
         "(throughput ratio vs Adam: predicted / measured)."]
  for (f, rate) in dict.fromkeys((r["file"], r["rate"]) for r in val):
    sel = {r["mode"]: r for r in val if (r["file"], r["rate"]) == (f, rate)}
    e = {m: sel[m]["pred"] / sel[m]["meas"] - 1 for m in sel}
    c = sel["onebit_compression"]
    out.append(f"- {f}, {rate}: Adam {e['adam']:+.0%}, warmup {e['onebit_warmup']:+.0%}, "
               f"1-bit compression {e['onebit_compression']:+.0%} ({c['ratio_pred']:.2f}x / "
               f"{c['ratio_meas']:.2f}x)")
  out.append("- hierarchical 2 x 2: " + ("; ".join(
      f"{r['rate']} {r['pred'] / r['meas'] - 1:+.0%} ({r['ratio_pred']:.2f}x / "
      f"{r['ratio_meas']:.2f}x)" for r in hier) if hier else "not measured yet"))
  size = a.params_list[0]
  sel = [r for r in rows if r["params"] == size]
  out += ["", f"| {size / 1e6:,.0f}M params: x Adam, flat / hier | "
          + " | ".join(f"{g:g} Gbit/s" for g in a.gbit_list) + " |",
          "|---" * (len(a.gbit_list) + 1) + "|"]
  for n in (a.rank_list[0], a.rank_list[1], a.rank_list[len(a.rank_list) // 2], a.rank_list[-1]):
    cells = [next(r for r in sel if r["n"] == n and r["gbit"] == g) for g in a.gbit_list]
    out.append(f"| {n} ranks | " + " | ".join(f"{r['x_flat']:.2f} / {r['x_hier']:.2f}"
                                             for r in cells) + " |")
  out.append(f"| {a.rank_list[-1]} ranks, whole run ({a.warmup_frac:.0%} warmup) | " + " | ".join(
      f"{r['x_flat_run']:.2f} / {r['x_hier_run']:.2f}" for r in cells) + " |")
  return out


def plot(rows: list[dict], a, path: Path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sizes = sorted({r["params"] for r in rows})
  fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
  for ax, size in zip(axes[0], sizes):
    for i, gbit in enumerate(a.gbit_list):
      sel = [r for r in rows if r["params"] == size and r["gbit"] == gbit]
      ns = [r["n"] for r in sel]
      ax.plot(ns, [r["x_hier"] for r in sel], "-o", color=f"C{i}", label=f"{gbit:g} Gbit/s hier")
      ax.plot(ns, [r["x_flat"] for r in sel], "--s", color=f"C{i}", label=f"{gbit:g} Gbit/s flat")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"ranks ({a.per_node} per node, one NIC)")
    ax.set_ylabel("throughput vs Adam (compression phase)")
    ax.set_title(f"{size / 1e6:,.0f}M parameters (model, GPU compute assumed)")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--params", default="340e6,1.3e9", help="model sizes (comma list; default "
                 "BERT-Large 340M and 1.3B)")
  p.add_argument("--gbit", default="10,25,100", help="inter-node link rates, Gbit/s")
  p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="ranks (multiples of --per-node)")
  p.add_argument("--per-node", type=int, default=8)
  p.add_argument("--nics-per-node", type=int, default=1)
  p.add_argument("--local-gbps", type=float, default=300.0, help="ASSUMED intra-node GB/s per device")
  p.add_argument("--alpha-local-us", type=float, default=5.0, help="ASSUMED intra-node latency")
  p.add_argument("--alpha-us", type=float, default=None, help="inter-node latency per message "
                 "(default: measured round trip / 2)")
  p.add_argument("--warmup-frac", type=float, default=0.15, help="fraction of steps before the freeze")
  p.add_argument("--segments", type=int, default=64, help="S, scales per chunk")
  p.add_argument("--tokens-per-gpu", type=int, default=4096, help="ASSUMED tokens per GPU per step")
  p.add_argument("--gpu-tflops", type=float, default=312.0, help="ASSUMED peak (A100 bf16 dense)")
  p.add_argument("--mfu", type=float, default=0.4, help="ASSUMED model FLOPs utilisation")
  p.add_argument("--hbm-gbps", type=float, default=2000.0, help="ASSUMED HBM GB/s (Adam update)")
  p.add_argument("--compress-ratio", type=float, default=None, help="1-bit compression step / Adam "
                 "update on the GPU (default: the CPU ratio of optimizer_compute.md)")
  p.add_argument("--warmup-ratio", type=float, default=None, help="likewise for the warmup step")
  p.add_argument("--hier-local-gbps", type=float, default=2.0, help="ASSUMED loopback GB/s inside a "
                 "namespace for the measured hierarchical run")
  p.add_argument("--out", default=str(RESULTS / "scaling_model.md"))
  a = p.parse_args(argv)
  a.params_list = [float(x) for x in a.params.split(",")]
  a.gbit_list = [float(x) for x in a.gbit.split(",")]
  a.rank_list = [int(x) for x in a.ranks.split(",")]
  a.query = "," not in a.params + a.gbit + a.ranks
  return a


def calibrate(a, docs) -> dict:
  alpha, eff = link_calibration(docs.values())
  f, f_src = server_fraction(docs["comm_throughput.json"])
  r_comp, r_warm, r_src = cpu_ratios()
  if a.compress_ratio is not None or a.warmup_ratio is not None:
    r_src = "set on the command line"
  return {"alpha": a.alpha_us * 1e-6 if a.alpha_us is not None else alpha, "eff": eff, "f": f,
          "f_src": f_src, "r_comp": a.compress_ratio or r_comp, "r_warm": a.warmup_ratio or r_warm,
          "r_src": r_src}


def commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def main(argv=None):
  a = parse_args(argv)
  docs = {n: load_json(n) for n in ("comm_throughput.json", "comm_throughput_rates.json")}
  cal = calibrate(a, docs)
  if a.query:
    print(query_line(predict_table(a.params_list[0], a, cal)[0], a))
    return
  val = validate(docs, cal["f"], server_seconds(docs["comm_throughput.json"]))
  hdoc = hier_measured()
  try:
    hier = validate_hier(hdoc, cal["f"], a.hier_local_gbps * 1e9) if hdoc else None
  except (KeyError, StopIteration, TypeError) as e:
    print(f"comm_throughput_hier.json found but not readable by this script: {e!r}")
    hier = None
  rows = [r for size in a.params_list for r in predict_table(size, a, cal)]
  cmd = "python benchmarks/scaling_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
  md = ["#### Scaling model: Adam vs flat and hierarchical 1-bit Adam (alpha-beta, not a measurement)",
        "", f"Command: `{cmd.strip()}` (commit {commit()}).", "",
        "##### Check against the measured 4-rank CPU runs (each rank its own namespace)", "",
        *validation_md(val, hier), "", "##### Assumptions", "", *assumptions_md(a, cal), "",
        "##### Prediction (compression phase, and the whole run with the warmup)", "",
        *table_md(rows), "", "![scaling_model](scaling_model.png)", ""]
  text = "\n".join(md)
  print(text)
  Path(a.out).write_text(text)
  summary = [f"Command: `{cmd.strip()}` (commit {commit()}): a model, not a measurement; GPU "
             "compute assumed (scaling_model.md).", "", *summary_md(val, hier, rows, a), ""]
  Path(a.out).with_name(Path(a.out).stem + "_summary.md").write_text("\n".join(summary))
  plot(rows, a, Path(a.out).with_suffix(".png"))


if __name__ == "__main__":
  main()
