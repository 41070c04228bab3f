"""A data shift half-way (prose -> Python source): does 1-bit Adam's frozen variance go stale? (issue 19)

    .venv/bin/python benchmarks/data_shift.py                 # the long run (see --help)
    .venv/bin/python benchmarks/data_shift.py --quick         # a smoke run, ~2 min
    .venv/bin/python benchmarks/data_shift.py --report-only   # re-render md/png from the json

The char GPT of ``_convergence_model.py`` (next-byte prediction, vocabulary 256)
trains on CPython's ``pydoc_data.topics`` prose for the first half of the steps
and on the standard library's own ``.py`` files (``sysconfig.get_paths()['stdlib']``,
sorted, the first 2 MB) for the second half: an abrupt shift at step T/2. Both
corpora hold out their last 10% (fixed validation windows); every ``--eval-every``
steps every optimizer is evaluated on both held-out sets. Every batch is a pure
function of ``(seed, step)``: the optimizers of one seed see the same
initialisation and the same batches.

Optimizers (8 simulated CPU devices, ``jax.shard_map`` data parallel, local
gradients, ``onebit_optax.clip_by_global_norm(1.0)`` for all; one schedule, one
peak learning rate, b1 0.9, b2 0.999, decoupled weight decay 0.1 on matrices):

* ``adamw``: ``optax.adamw`` on the float32 ``pmean`` of the gradients;
* ``onebit``: ``onebit_adam`` with its default freeze,
  ``variance_ratio_freeze(min_steps=<LR warmup>)``: the variance is frozen once,
  early, on prose;
* ``zero_one``: ``zero_one_adam`` with ``var_freeze_step=T`` (the variance is
  never frozen: refreshed on exponentially spaced variance steps, the interval
  doubling every ``var_update_scaler=16`` of them), no local steps; each variance
  step decays v by b2 (DeepSpeed's EMA over variance steps);
* ``zero_one_step``: the same with ``variance_ema='per_step'`` (a variance step
  decays v by b2 per step since the previous one: Adam's horizon in steps);
* ``onebit_restart``: the remedy a user can apply with today's public API: at the
  shift, keep 1-bit Adam's parameters and start a *new* ``onebit_adam`` state
  (its schedule continues where the old one was, ``lambda c: schedule(c + T/2)``;
  the same freeze rule, so a new full-precision warmup measures the new
  variance and freezes it again). It branches off the ``onebit`` run at the
  shift (the same first half).

Results: ``benchmarks/results/data_shift.{json,md,png}``. The json is rewritten
after every evaluation, so a run cut short still leaves its curves; the md and
png are rewritten after every finished run (and by ``--report-only``).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _convergence_model as lm  # noqa: E402
import _diloco  # noqa: E402
import _provenance  # noqa: E402
import _shift_report  # noqa: E402

import onebit_optax  # noqa: E402
from onebit_optax import _collective  # noqa: E402

N, AXIS = 8, "data"
B1, B2 = 0.9, 0.999
CODE_BYTES = 2_000_000
KINDS = ("adamw", "onebit", "zero_one", "zero_one_step", "onebit_restart", "diloco")
# Options added after the first runs: an --append may add them to the stored configuration.
ADDED_OPTIONS = ("diloco_inner_steps", "diloco_outer_lr")
# The control: the same runs without the shift (prose all the way): does the gap
# grow with time anyway?
CONTROLS = ("adamw_noshift", "onebit_noshift")
RESULTS = os.path.join(HERE, "results")


# ----------------------------------------------------------------------------
# Data.


def load_code() -> np.ndarray:
  """The standard library's top-level ``.py`` files, sorted by name, joined, the first 2 MB."""
  stdlib = sysconfig.get_paths()["stdlib"]
  parts = []
  for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
    with open(path, "rb") as f:
      parts.append(f.read())
  data = b"".join(parts)[:CODE_BYTES]
  return np.frombuffer(data, dtype=np.uint8)


def corpora():
  """{'prose': (train, val), 'code': (train, val)}: the last 10% of each held out."""
  return dict(prose=lm.split(lm.load_corpus("prose")), code=lm.split(load_code()))


def train_corpus(step: int, steps: int, shift: bool = True) -> str:
  """Steps 1..T/2 train on prose, T/2+1..T on Python source (without ``shift``: prose throughout)."""
  return "prose" if step <= steps // 2 or not shift else "code"


# ----------------------------------------------------------------------------
# Optimizers.


def schedule_of(cfg):
  return optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], cfg["warmup"], cfg["steps"],
                                            cfg["lr"] * cfg["end_fraction"])


def base_kind(kind: str) -> str:
  return kind[: -len("_noshift")] if kind.endswith("_noshift") else kind


def make_tx(kind: str, cfg, offset: int = 0):
  kind = base_kind(kind)
  sched = schedule_of(cfg)
  if offset:
    sched = (lambda s, o: (lambda c: s(c + o)))(sched, offset)
  common = dict(b1=B1, b2=B2, weight_decay=cfg["weight_decay"], mask=lm.decay_mask)
  if kind == "adamw":
    return optax.adamw(sched, **common)
  if kind in ("onebit", "onebit_restart"):
    return onebit_optax.onebit_adam(
        sched, axis_name=AXIS, freeze=onebit_optax.variance_ratio_freeze(min_steps=cfg["warmup"]),
        **common)
  if kind in ("zero_one", "zero_one_step"):
    return onebit_optax.zero_one_adam(
        sched, axis_name=AXIS, var_freeze_step=cfg["steps"],
        var_update_scaler=cfg["var_update_scaler"],
        variance_ema="per_step" if kind == "zero_one_step" else "per_update", **common)
  if kind == "diloco":  # each device clips its own gradient: it trains on its own between rounds
    inner = optax.chain(optax.clip_by_global_norm(cfg["clip"]), optax.adamw(sched, **common))
    return _diloco.diloco(inner, _diloco.outer_sgd(cfg["diloco_outer_lr"]),
                          cfg["diloco_inner_steps"], AXIS, last_step=cfg["steps"])
  raise ValueError(kind)


def _find(tree, cls):
  found = [s for s in jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, cls))
           if isinstance(s, cls)]
  assert len(found) == 1, (cls, len(found))
  return found[0]


def family(kind: str) -> str:
  return {"adamw": "adamw", "onebit": "onebit", "onebit_restart": "onebit",
          "zero_one": "zero_one", "zero_one_step": "zero_one", "diloco": "diloco"}[base_kind(kind)]


class Trainer:
  """One compiled chunk of ``eval_every`` steps (``lax.scan`` under ``shard_map``) per optimizer."""

  def __init__(self, cfg, mesh, data):
    self.cfg, self.mesh, self.data = cfg, mesh, data
    self.mcfg = lm.ModelConfig(d_model=cfg["d_model"], num_layers=cfg["layers"],
                               num_heads=cfg["heads"], seq_len=cfg["seq_len"])
    self.size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.init(0)))
    self.allreduce_bytes = float(_collective.allreduce_wire_bytes(self.size, N))
    shard = NamedSharding(mesh, P(AXIS))
    self.val = {}
    for name, (_, val) in data.items():
      full = lm.val_batches(val, cfg["seq_len"], None, N)
      part = lm.val_batches(val, cfg["seq_len"], cfg["val_seqs"], N)
      self.val[name] = dict(
          full=tuple(jax.device_put(a, shard) for a in full),
          periodic=tuple(jax.device_put(a, shard) for a in part),
          n_full=int(len(full[0])), n_periodic=int(len(part[0])))
    self._evaluate = self._build_eval()
    self._chunks = {}

  def init(self, seed):
    return lm.init_params(jax.random.key(seed), self.mcfg)

  def loss(self, params, x, y):
    return lm.loss_fn(params, x, y, self.mcfg)

  # ---- state

  def init_state(self, kind, params, offset=0):
    tx = make_tx(kind, self.cfg, offset)
    fam = family(kind)
    if fam == "adamw":
      opt = jax.device_put(tx.init(params), NamedSharding(self.mesh, P()))
      specs = jax.tree.map(lambda _: P(), opt)
    elif fam == "onebit":
      opt = onebit_optax.init_sharded(tx, params, self.mesh, AXIS)
      specs = onebit_optax.state_partition_specs(opt, AXIS)
    elif fam == "diloco":
      opt, specs = _diloco.init_sharded(tx, params, self.mesh, AXIS)
    else:
      opt = onebit_optax.init_sharded(tx, params, self.mesh)
      specs = onebit_optax.state_partition_specs(opt, AXIS)
    return tx, opt, specs

  # ---- compiled chunk

  def chunk_fn(self, kind, tx, specs, key):
    if key in self._chunks:
      return self._chunks[key]
    fam = family(kind)
    clip = onebit_optax.clip_by_global_norm(self.cfg["clip"], axis_name=AXIS)
    allreduce = jnp.float32(self.allreduce_bytes)

    def step(params, opt, batch):
      x, y = batch
      if fam == "zero_one":
        local = onebit_optax.local_params(params, AXIS, opt)
      elif fam == "diloco":  # this device's point (a per-device value: local gradients)
        local = _diloco.local_point(params, opt)
      else:
        local = onebit_optax.local_params(params, AXIS)
      loss, grads = jax.value_and_grad(self.loss)(local, x, y)
      if fam != "diloco":  # (DiLoCo's inner chain clips each device's own gradient)
        grads, _ = clip.update(grads, clip.init(None))
      if fam == "adamw":
        updates, opt = tx.update(jax.lax.pmean(grads, AXIS), opt, params)
        wire = allreduce
      else:
        updates, opt = tx.update(grads, opt, params)
        cls = {"onebit": onebit_optax.ScaleByOnebitAdamState, "diloco": _diloco.DiLoCoState,
               "zero_one": onebit_optax.ScaleByZeroOneAdamState}[fam]
        wire = _find(opt, cls).wire_bytes.astype(jnp.float32)
      return optax.apply_updates(params, updates), opt, (loss[None], wire)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=self.mesh,
                       in_specs=(P(), specs, P(None, AXIS)),
                       out_specs=(P(), specs, (P(None, AXIS), P())))
    def chunk(params, opt, batches):
      def body(carry, batch):
        params, opt = carry
        params, opt, out = step(params, opt, batch)
        return (params, opt), out
      (params, opt), out = jax.lax.scan(body, (params, opt), batches)
      return params, opt, out

    self._chunks[key] = chunk
    return chunk

  def _build_eval(self):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                       out_specs=P(AXIS))
    def evaluate(params, x, y):
      return jnp.stack([self.loss(params, x, y) * y.size, jnp.float32(y.size)])[None]
    return lambda params, xy: float(np.divide(*np.asarray(evaluate(params, *xy)).sum(0)))

  def evaluate(self, params, which="periodic"):
    return {name: self._evaluate(params, v[which]) for name, v in self.val.items()}

  def batches(self, seed, steps, shift=True):
    gb = N * self.cfg["batch_per_device"]
    per = [lm.train_batch(self.data[train_corpus(s, self.cfg["steps"], shift)][0], s, seed, gb,
                          self.cfg["seq_len"]) for s in steps]
    shard = NamedSharding(self.mesh, P(None, AXIS))
    return tuple(jax.device_put(np.stack(leaf), shard) for leaf in zip(*per))


# ----------------------------------------------------------------------------
# The preconditioner, read off the states (host side): sum of v_hat per group.


def group_of(path) -> str:
  keys = [getattr(k, "key", str(k)) for k in path]
  if keys[0] in ("embed", "head", "pos"):
    return keys[0]
  if keys[0].startswith("block") and keys[1] in ("qkv", "proj", "fc", "out") and keys[2] == "w":
    return {"qkv": "attn", "proj": "attn", "fc": "mlp", "out": "mlp"}[keys[1]]
  return "vectors"  # biases and LayerNorm


GROUPS = ("embed", "pos", "head", "attn", "mlp", "vectors")


def v_hat_groups(kind, opt):
  """Per parameter group, the sum of the bias-corrected second moment the optimizer divides by now."""
  fam = family(kind)
  if fam == "adamw":
    s = _find(opt, optax.ScaleByAdamState)
    nu, corr = s.nu, 1.0 - B2 ** int(s.count)
  elif fam == "onebit":
    s = _find(opt, onebit_optax.ScaleByOnebitAdamState)
    t = int(s.freeze_step) if bool(s.frozen) else int(s.count)
    nu, corr = s.nu, 1.0 - B2 ** max(t, 1)
  elif fam == "diloco":  # device 0's inner AdamW
    s = _find(opt.inner, optax.ScaleByAdamState)
    nu = jax.tree.map(lambda v: np.asarray(v)[0], jax.device_get(s.nu))
    corr = 1.0 - B2 ** max(int(np.asarray(jax.device_get(s.count))[0]), 1)
  else:
    s = _find(opt, onebit_optax.ScaleByZeroOneAdamState)
    last = int(s.variance_step) if kind == "zero_one_step" else int(s.variance_updates)
    nu, corr = s.nu, 1.0 - B2 ** max(last, 1)
  out = dict.fromkeys(GROUPS, 0.0)
  for path, v in jax.tree_util.tree_flatten_with_path(jax.device_get(nu))[0]:
    out[group_of(path)] += float(np.sum(np.asarray(v, np.float64))) / corr
  return out


def opt_info(kind, opt):
  fam = family(kind)
  if fam == "onebit":
    s = _find(opt, onebit_optax.ScaleByOnebitAdamState)
    return dict(frozen=bool(s.frozen), freeze_step=int(s.freeze_step) if bool(s.frozen) else None)
  if fam == "zero_one":
    s = _find(opt, onebit_optax.ScaleByZeroOneAdamState)
    return dict(variance_updates=int(s.variance_updates), var_interval=int(s.var_interval),
                variance_step=int(s.variance_step))
  return {}


# ----------------------------------------------------------------------------


def uptime() -> str:
  try:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
  except OSError:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _jaxlib_version() -> str:
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return "unknown"


def run_one(trainer, kind, seed, results, save, branch=None):
  """Trains one optimizer on one seed; appends evaluation points to ``results`` as it goes.

  ``branch``: (params, record) of the ``onebit`` run at the shift, for ``onebit_restart``.
  """
  cfg = trainer.cfg
  T, E, half = cfg["steps"], cfg["eval_every"], cfg["steps"] // 2
  wall0 = time.time()
  rec = dict(kind=kind, seed=seed, steps=[], val_prose=[], val_code=[], train_loss=[],
             bytes=[], v_hat=[], info=[], done=False, git=_provenance.git_commit())
  results["runs"].append(rec)
  shift_params = None
  if branch is None:
    params = jax.device_put(trainer.init(seed), NamedSharding(trainer.mesh, P()))
    tx, opt, specs = trainer.init_state(kind, params)
    start, cum = 0, 0.0
    ev = trainer.evaluate(params)
    rec["steps"].append(0); rec["val_prose"].append(ev["prose"]); rec["val_code"].append(ev["code"])
    rec["train_loss"].append(float("nan")); rec["bytes"].append(0.0)
    rec["v_hat"].append(None); rec["info"].append(opt_info(kind, opt))
  else:
    params, parent = branch
    i = parent["steps"].index(half)
    for key in ("steps", "val_prose", "val_code", "train_loss", "bytes", "v_hat", "info"):
      rec[key] = list(parent[key][: i + 1])
    tx, opt, specs = trainer.init_state(kind, params, offset=half)
    start, cum = half, rec["bytes"][-1]
  chunk = trainer.chunk_fn(kind, tx, specs, key=(base_kind(kind), start))
  shift = not kind.endswith("_noshift")
  for s0 in range(start, T, E):
    steps = range(s0 + 1, min(s0 + E, T) + 1)
    params, opt, (loss, wire) = jax.block_until_ready(
        chunk(params, opt, trainer.batches(seed, steps, shift)))
    cum += float(np.sum(np.asarray(wire, np.float64)))
    ev = trainer.evaluate(params)
    rec["steps"].append(steps[-1]); rec["val_prose"].append(ev["prose"])
    rec["val_code"].append(ev["code"]); rec["train_loss"].append(float(np.mean(loss)))
    rec["bytes"].append(cum); rec["v_hat"].append(v_hat_groups(kind, opt))
    rec["info"].append(opt_info(kind, opt))
    if steps[-1] == half:
      shift_params = params
    save()
    print(f"{kind} seed {seed} step {steps[-1]}: prose {ev['prose']:.4f} code {ev['code']:.4f} "
          f"bytes {cum / 1e6:.1f} MB {opt_info(kind, opt)} ({time.time() - wall0:.0f} s)",
          flush=True)
  final = trainer.evaluate(params, "full")
  rec.update(final_prose=final["prose"], final_code=final["code"], done=True,
             wall_s=time.time() - wall0)
  save()
  return shift_params


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smoke run: 200 steps, tiny model")
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--batch-per-device", type=int, default=4)
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--val-seqs", type=int, default=256)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--var-update-scaler", type=int, default=16)
  parser.add_argument("--diloco-inner-steps", type=int, default=16, help="DiLoCo's H")
  parser.add_argument("--diloco-outer-lr", type=float, default=0.7)
  parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS + CONTROLS)
  parser.add_argument("--append", action="store_true",
                      help="add the runs (kind, seed) not yet done to the existing json (same "
                      "configuration); each invocation is recorded")
  parser.add_argument("--rerun", action="store_true",
                      help="with --append: drop the stored runs of --kinds (those seeds) and run "
                      "them again, e.g. after a change of that optimizer")
  parser.add_argument("--out", default=os.path.join(RESULTS, "data_shift"),
                      help="path prefix of the .json/.md/.png")
  parser.add_argument("--report-only", action="store_true")
  args = parser.parse_args(argv)
  if args.report_only:
    with open(args.out + ".json") as f:
      results = json.load(f)
    _shift_report.write(results, args.out)
    return
  if args.rerun and not args.append:
    raise SystemExit("--rerun replaces stored runs: give it with --append")
  if args.quick:
    args.steps, args.seeds, args.eval_every, args.val_seqs = 200, [0], 25, 64
  steps = args.steps
  if steps % (2 * args.eval_every):
    raise SystemExit("--steps must be a multiple of 2 x --eval-every (the shift on an evaluation)")
  cfg = dict(steps=steps, warmup=max(1, steps // 20), lr=args.lr, end_fraction=0.1,
             weight_decay=0.1, clip=1.0, d_model=args.d_model, layers=args.layers,
             heads=args.heads, seq_len=args.seq_len, batch_per_device=args.batch_per_device,
             eval_every=args.eval_every, val_seqs=args.val_seqs,
             var_update_scaler=args.var_update_scaler, devices=N, b1=B1, b2=B2,
             code_bytes=CODE_BYTES, diloco_inner_steps=args.diloco_inner_steps,
             diloco_outer_lr=args.diloco_outer_lr)
  wall0 = time.time()
  mesh = jax.make_mesh((N,), (AXIS,))
  data = corpora()
  trainer = Trainer(cfg, mesh, data)
  prose_bytes, code_bytes = (set(np.unique(data[k][0]).tolist()) for k in ("prose", "code"))
  meta = dict(command="python benchmarks/data_shift.py " + " ".join(sys.argv[1:] if argv is None
                                                                      else argv),
              git=_provenance.git_commit(), jax=jax.__version__, jaxlib=_jaxlib_version(),
              optax=optax.__version__, onebit_optax=onebit_optax.__version__,
              python=platform.python_version(), machine=f"{platform.machine()}, "
              f"{os.cpu_count()} CPUs", started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              uptime_start=uptime(), params=trainer.size, allreduce_bytes=trainer.allreduce_bytes,
              corpora={k: dict(train=int(len(v[0])), val=int(len(v[1])),
                               val_windows_periodic=trainer.val[k]["n_periodic"],
                               val_windows_full=trainer.val[k]["n_full"])
                       for k, v in data.items()},
              stdlib=sysconfig.get_paths()["stdlib"],
              code_only_bytes=sorted(code_bytes - prose_bytes), quick=args.quick)
  out = args.out + ("_quick" if args.quick and args.out.endswith("data_shift") else "")
  invocation = {k: meta[k] for k in ("command", "git", "started", "uptime_start")}
  if args.append:
    with open(out + ".json") as f:
      results = json.load(f)
    old = dict(results["config"])
    old.update({k: cfg[k] for k in ADDED_OPTIONS if k not in old})  # (stored runs predate them)
    if old != cfg:
      raise SystemExit(f"--append: the configuration differs from {out}.json's: "
                       f"{ {k: (old.get(k), v) for k, v in cfg.items() if old.get(k) != v} }")
    results["config"] = old
    results["runs"] = [r for r in results["runs"] if r["done"] and not (
        args.rerun and r["kind"] in args.kinds and r["seed"] in args.seeds)]
    results["meta"].setdefault("invocations", [
        {k: results["meta"][k] for k in ("command", "git", "started", "uptime_start",
                                         "uptime_end", "wall_s")}])
    wall_before = sum(i["wall_s"] for i in results["meta"]["invocations"])
  else:
    results = dict(config=cfg, meta=dict(meta, invocations=[]), runs=[])
    wall_before = 0.0
  results["meta"]["invocations"].append(invocation)
  done = {(r["kind"], r["seed"]) for r in results["runs"]}

  def save():
    invocation.update(uptime_end=uptime(), wall_s=time.time() - wall0)
    results["meta"].update(uptime_end=invocation["uptime_end"],
                           wall_s=wall_before + invocation["wall_s"])
    with open(out + ".json.tmp", "w") as f:
      json.dump(results, f)
    os.replace(out + ".json.tmp", out + ".json")

  print(f"{trainer.size:,} parameters; {meta['uptime_start']}", flush=True)
  for seed in args.seeds:
    shift_params = None
    for kind in args.kinds:
      if (kind, seed) in done:
        print(f"{kind} seed {seed}: done already")
        continue
      if kind == "onebit_restart":
        parent = [r for r in results["runs"] if r["kind"] == "onebit" and r["seed"] == seed]
        if not parent or shift_params is None:
          print("onebit_restart needs the onebit run of the same seed first; skipped")
          continue
        run_one(trainer, kind, seed, results, save, branch=(shift_params, parent[0]))
      else:
        sp = run_one(trainer, kind, seed, results, save)
        if kind == "onebit":
          shift_params = sp
      save()
      try:  # a report bug must not stop the runs: --report-only re-renders from the json.
        _shift_report.write(results, out)
      except Exception:  # pylint: disable=broad-except
        import traceback  # pylint: disable=g-import-not-at-top
        traceback.print_exc()
  save()
  _shift_report.write(results, out)
  print(f"wall {time.time() - wall0:.0f} s; {uptime()}")


if __name__ == "__main__":
  main()
