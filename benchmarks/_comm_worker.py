"""One rank of benchmarks/comm_throughput.py (started by it; not meant to be run by hand).

Subcommands:
  rank        train the embedding-heavy model with optax.adam (+ pmean of the
              gradients), then with onebit_adam (warmup steps, then compression
              steps), timing each step and reading the interface's (and
              loopback's) byte counters; with --mesh NxK also on a 2-D
              ('node', 'local') mesh: Adam's pmean over both axes and
              hierarchical onebit_adam (axis_name=('node', 'local')); with
              the zero_one mode also 0/1 Adam on its real schedule (variance,
              compressed, local and sync steps), every step's phase recorded
              and the counters read at each change of phase. Writes one JSON
              file per rank.
  tcp-server  / tcp-client: a plain TCP goodput and round-trip probe, so the
              alpha-beta model uses the bandwidth the link really gives.

The parent sets XLA_FLAGS (one intra-op thread) and pins the process to a core
before this module imports JAX.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from optax.tree_utils import tree_get

_PORT = 5901


def _tcp_server(nbytes: int):
  srv = socket.socket()
  srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  srv.bind(("0.0.0.0", _PORT))
  srv.listen(1)
  srv.settimeout(60)
  conn, _ = srv.accept()
  conn.settimeout(60)
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  # Round trips first (1-byte ping-pong), then the bulk transfer.
  for _ in range(200):
    conn.sendall(conn.recv(1))
  buf = bytearray(1 << 20)
  got, start = 0, None
  while got < nbytes:
    k = conn.recv_into(buf)
    if not k:
      break
    if start is None:
      start = time.perf_counter()
      first = k
    got += k
  elapsed = time.perf_counter() - start
  conn.sendall(b"k")
  print(f"goodput_Bps={(got - first) / elapsed}")


def _tcp_client(nbytes: int, host: str):
  for attempt in range(300):  # the server may still be starting
    try:
      conn = socket.create_connection((host, _PORT), timeout=60)
      break
    except ConnectionRefusedError:
      if attempt == 299:
        raise
      time.sleep(0.2)
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  rtts = []
  for _ in range(200):
    t = time.perf_counter()
    conn.sendall(b"x")
    conn.recv(1)
    rtts.append(time.perf_counter() - t)
  data = b"x" * (1 << 20)
  for start in range(0, nbytes, len(data)):
    conn.sendall(data[:nbytes - start])
  conn.recv(1)
  rtts.sort()
  print(f"rtt_s={rtts[len(rtts) // 2]}")


def _counter(iface: str, which: str) -> int:
  try:
    with open(f"/sys/class/net/{iface}/statistics/{which}") as f:
      return int(f.read())
  except OSError:  # sysfs not mounted for this namespace: /proc/net/dev is per netns
    with open("/proc/net/dev") as f:
      for line in f:
        name, _, rest = line.partition(":")
        if name.strip() == iface:
          fields = rest.split()
          return int(fields[0] if which == "rx_bytes" else fields[8])
  raise RuntimeError(f"no byte counter for interface {iface}")


def _meshes(args):
  """The 1-D mesh ('data',) of all ranks and, with --mesh, the 2-D ('node', 'local') one.

  jax.make_mesh lays CPU devices out in jax.devices() order; the check makes
  sure that row k of the 2-D mesh holds the ranks of node k (the ranks sharing
  its namespace), e.g. processes 0, 1 on 'node' 0 and 2, 3 on 'node' 1.
  """
  import jax
  import numpy as np

  flat = jax.make_mesh((args.num_ranks,), ("data",))
  if not args.mesh:
    return flat, None
  shape = tuple(int(k) for k in args.mesh.split("x"))
  mesh = jax.make_mesh(shape, ("node", "local"))
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  if args.num_ranks > 1 and not (procs == np.arange(procs.size).reshape(shape)).all():
    raise RuntimeError(f"2-D mesh rows are not nodes: process ids {procs.tolist()}")
  return flat, mesh


class _Bench:
  """The model, the data and the timing loop shared by every optimizer mode."""

  def __init__(self, args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    self.args = args
    # An embedding-bag classifier: almost all parameters sit in the embedding
    # table, while the forward/backward pass touches only batch*seq rows of it, so
    # the dense gradient (and its all-reduce) dominate the step, as in
    # embedding-heavy recommendation and language models.
    vocab, dim, hidden, classes = args.vocab, args.dim, 64, 16
    self.classes = classes

    def init_params(key):
      k1, k2, k3 = jax.random.split(key, 3)
      return {
          "embed": 0.02 * jax.random.normal(k1, (vocab, dim)),
          "w1": jax.random.normal(k2, (dim, hidden)) / np.sqrt(dim),
          "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k3, (hidden, classes)) / np.sqrt(hidden),
          "b2": jnp.zeros(classes),
      }

    def loss_fn(params, tokens, labels):
      bag = params["embed"][tokens].mean(axis=1)
      h = jnp.tanh(bag @ params["w1"] + params["b1"])
      logits = h @ params["w2"] + params["b2"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    self.init_params, self.loss_fn = init_params, loss_fn
    self.shapes = jax.eval_shape(init_params, jax.random.key(0))
    self.num_params = sum(x.size for x in jax.tree.leaves(self.shapes))

  def params(self, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    return jax.jit(self.init_params, out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))

  def batch(self, mesh, axis):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    n, a = self.args.num_ranks, self.args

    def make(key):
      k1, k2 = jax.random.split(key)
      tokens = jax.random.randint(k1, (n * a.batch, a.seq), 0, a.vocab)
      return tokens, jax.random.randint(k2, (n * a.batch,), 0, self.classes)
    batched = NamedSharding(mesh, P(axis))
    return jax.jit(make, out_shardings=(batched, batched))(jax.random.key(1))

  def make_step(self, mesh, axis, tx, state_specs, reduce_grads, grad_params=None):
    """The jitted shard_map train step; ``grad_params(params, opt_state)``: where to differentiate.

    Default: ``local_params(params, axis)`` (this device's typed copy); 0/1 Adam
    with local steps needs ``local_params(params, axis, opt_state)``.
    """
    import functools

    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import onebit_optax
    # With one rank and Adam, no pmean (see below), so the gradients stay typed
    # as varying: turn the type check off rather than add a copy. With one rank
    # and 1-bit Adam (core v3), the 1-device exchange returns the rank's own
    # (varying) rows where the warmup branch's message is replicated, and the
    # lax.cond between the phases refuses the mismatch under the type check:
    # the compute-alone runs turn it off as well (the program is the same).
    single_adam = reduce_grads and self.args.num_ranks == 1
    check_vma = self.args.num_ranks > 1

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), state_specs, P(axis), P(axis)),
        out_specs=(P(), state_specs, P()), check_vma=check_vma)
    def step(params, opt_state, tokens, labels):
      # Local gradients (no all-reduce in the backward pass); each optimizer
      # decides how to average them.
      at = (onebit_optax.local_params(params, axis) if grad_params is None
            else grad_params(params, opt_state))
      loss, grads = jax.value_and_grad(self.loss_fn)(at, tokens, labels)
      if reduce_grads and not single_adam:
        # (With one rank XLA keeps a 1-participant all-reduce, a full copy that
        # would be counted as compute in the compute-alone run.)
        grads = jax.lax.pmean(grads, axis)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis)
    return step

  def run_block(self, step, state, batch, nsteps):
    """``nsteps`` timed steps; bytes from the interface's (and loopback's) counters."""
    import jax
    ifaces = {"": self.args.iface, "lo_": "lo"}
    before = {k: (_counter(i, "tx_bytes"), _counter(i, "rx_bytes")) for k, i in ifaces.items()}
    times = []
    for _ in range(nsteps):
      t = time.perf_counter()
      state = step(*state, *batch)[:2]
      jax.block_until_ready(state)
      times.append(time.perf_counter() - t)
    block = {"step_s": times}
    for k, i in ifaces.items():
      block[f"{k}tx_bytes_per_step"] = (_counter(i, "tx_bytes") - before[k][0]) / nsteps
      block[f"{k}rx_bytes_per_step"] = (_counter(i, "rx_bytes") - before[k][1]) / nsteps
    return state, block

  def timed(self, step, state, batch):
    """``repeats`` blocks of ``steps`` timed steps."""
    blocks = []
    for _ in range(self.args.repeats):
      state, block = self.run_block(step, state, batch, self.args.steps)
      blocks.append(block)
    return state, blocks


def _replicated_value(x):
  import numpy as np
  return np.asarray(x.addressable_data(0)).item()


def _time_adam(bench, mesh, axis):
  """optax.adam on the pmean (over every axis in ``axis``) of the local gradients."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  tx = optax.adam(1e-3)
  params = bench.params(mesh)
  opt_state = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)
  step = bench.make_step(mesh, axis, tx, P(), reduce_grads=True)
  batch = bench.batch(mesh, axis)
  t = time.perf_counter()
  state, _ = bench.run_block(step, (params, opt_state), batch, 1)
  first = time.perf_counter() - t
  _, blocks = bench.timed(step, state, batch)
  return {"first_step_s": first, "blocks": blocks}


def _time_onebit(bench, mesh, axis, time_warmup: bool) -> dict:
  """onebit_adam over ``axis``: (optionally timed) warmup steps, then compression steps.

  One compiled program serves both phases (the switch is a lax.cond on the
  state): step 1 compiles, then, with ``time_warmup``, ``repeats * steps`` timed
  warmup steps follow; the variance freezes at the end of the last warmup step,
  one untimed compression step follows, then the timed compression steps.
  """
  import onebit_optax
  a = bench.args
  freeze_at = 1 + (a.repeats * a.steps if time_warmup else 0)
  tx = onebit_optax.onebit_adam(
      1e-3, axis_name=axis, freeze=onebit_optax.fixed_step_freeze(freeze_at))
  params = bench.params(mesh)
  opt_state = onebit_optax.init_sharded(tx, params, mesh, axis_name=axis)
  step = bench.make_step(mesh, axis, tx, onebit_optax.state_partition_specs(opt_state, axis),
                         reduce_grads=False)
  batch = bench.batch(mesh, axis)
  t = time.perf_counter()
  state, _ = bench.run_block(step, (params, opt_state), batch, 1)
  out = {"warmup": {"first_step_s": time.perf_counter() - t}}
  if time_warmup:
    state, out["warmup"]["blocks"] = bench.timed(step, state, batch)
    out["warmup"]["state_wire_bytes"] = _replicated_value(tree_get(state[1], "wire_bytes"))
  assert _replicated_value(tree_get(state[1], "frozen")), "did not freeze"
  state, _ = bench.run_block(step, state, batch, 1)
  state, blocks = bench.timed(step, state, batch)
  out["compression"] = {"blocks": blocks,
                        "state_wire_bytes": _replicated_value(tree_get(state[1], "wire_bytes"))}
  return out


# 0/1 Adam's hyperparameters for the timed run (comm_throughput.py passes them on).
ZERO_ONE_DEFAULTS = dict(var_freeze_step=40, var_update_scaler=4, local_steps=8,
                         local_step_scaler=4)
ZERO_ONE_STEPS = 72  # steps of the timed run (step 1 compiles, untimed)
PHASE_CODES = "vcls"  # status(state).phase: variance, compressed, local, sync


def zero_one_state(opt_state):
  """The one ScaleByZeroOneAdamState inside an optax state."""
  import jax

  import onebit_optax
  cls = onebit_optax.ScaleByZeroOneAdamState
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, cls))
           if isinstance(s, cls)]
  assert len(found) == 1, found
  return found[0]


def phase_schedule(nsteps: int, **hyper) -> str:
  """The phase of each of ``nsteps`` steps of zero_one_adam(**hyper): one letter a step (vcls).

  Runs the optimizer itself on a 2-element problem on one device
  (axis_name=None; the schedule depends only on the step counters, the
  gradients being finite), reading ``phase`` after every step as
  ``status(state).phase`` does. Used to know before a step whether it starts a new
  phase (the counters are then read after the links went quiet), and by
  comm_throughput.py for the phase counts of a whole run.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import onebit_optax
  tx = onebit_optax.zero_one_adam(1e-3, axis_name=None, **hyper)
  params = {"w": jnp.ones(2)}

  def body(carry, _):
    p, s = carry
    u, s = tx.update({"w": jnp.array([1.0, -2.0])}, s, p)
    return (optax.apply_updates(p, u), s), zero_one_state(s).phase

  device = jax.local_devices()[0]
  with jax.default_device(device):
    _, phases = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=nsteps))(
        params, tx.init(params))
  return "".join(PHASE_CODES[int(k)] for k in np.asarray(phases))


def _time_zero_one(bench, mesh, axis, hyper: dict, nsteps: int, settle_s: float,
                   read_each_step: bool = False) -> dict:
  """zero_one_adam over ``axis`` on its real schedule: every step timed, its phase recorded.

  Step 1 compiles (one program serves every phase: a lax.switch on the
  state's counters) and is not timed. The steps then run back to back, in
  windows: a window is a run of consecutive steps of one phase (known
  beforehand from ``phase_schedule``); at each window's ends the ranks wait
  ``settle_s`` (untimed) so that the last bytes of the previous step have left
  the interface, and the counters are read. So a window of local steps shows
  what local steps send, not the tail of the sync before them. Each step's
  phase as the state reports it (``status(state).phase``) and the optimizer's own
  ``wire_bytes`` are copied on the device after the step and read after the run,
  then checked against the prediction. Reading them on the host after each step
  (``read_each_step``, as before issue 25's item 6 was measured) stalls this
  rank between steps while the others already wait in the next step's
  collectives: that wait was timed as communication.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  import onebit_optax
  predicted = phase_schedule(nsteps, **hyper)
  tx = onebit_optax.zero_one_adam(1e-3, axis_name=axis, **hyper)
  params = bench.params(mesh)
  opt_state = onebit_optax.init_sharded(tx, params, mesh, axis_name=axis)
  specs = onebit_optax.state_partition_specs(opt_state, axis)
  step = bench.make_step(mesh, axis, tx, specs, reduce_grads=False,
                         grad_params=lambda p, s: onebit_optax.local_params(p, axis, s))
  batch = bench.batch(mesh, axis)
  ifaces = {"": bench.args.iface, "lo_": "lo"}

  def counters():
    return {k: (_counter(i, "tx_bytes"), _counter(i, "rx_bytes")) for k, i in ifaces.items()}

  def mark(state):  # this rank's copies of the step's phase and wire_bytes (asynchronous)
    z = zero_one_state(state[1])
    return [jnp.copy(x.addressable_data(0)) for x in (z.phase, z.wire_bytes)]

  def read(marked):
    return PHASE_CODES[int(np.asarray(marked[0]))], float(np.asarray(marked[1]))

  t = time.perf_counter()
  state = jax.block_until_ready(step(params, opt_state, *batch)[:2])
  first = time.perf_counter() - t
  marks = [mark(state)]
  windows, window, before = [], None, None
  for k in range(1, nsteps):
    if window is None or predicted[k] != window["phase"]:
      time.sleep(settle_s)
      now = counters()
      if window is not None:
        windows.append(_close_window(window, before, now))
      window, before = {"phase": predicted[k], "first_step": k + 1, "step_s": []}, now
    t = time.perf_counter()
    state = step(*state, *batch)[:2]
    jax.block_until_ready(state)
    window["step_s"].append(time.perf_counter() - t)
    marks.append(mark(state))
    if read_each_step:  # the host waits for them here, between this step and the next
      jax.device_get(marks[-1])
  time.sleep(settle_s)
  windows.append(_close_window(window, before, counters()))
  phases, wire = zip(*(read(m) for m in marks))
  actual = "".join(phases)
  return {"first_step_s": first, "hyper": hyper, "nsteps": nsteps, "settle_s": settle_s,
          "read_each_step": read_each_step,
          "predicted_schedule": predicted, "schedule": actual,
          "schedule_matches": actual == predicted, "state_wire_bytes": list(wire),
          "windows": windows}


def _close_window(window: dict, before: dict, after: dict) -> dict:
  n = len(window["step_s"])
  out = dict(window, steps=n)
  for k in before:
    out[f"{k}tx_bytes"] = after[k][0] - before[k][0]
    out[f"{k}rx_bytes"] = after[k][1] - before[k][1]
    out[f"{k}tx_bytes_per_step"] = out[f"{k}tx_bytes"] / n
  return out


def _rank(args):
  import jax

  if args.num_ranks > 1:
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.num_ranks,
        process_id=args.rank, initialization_timeout=300)
  assert len(jax.devices()) == args.num_ranks, jax.devices()
  flat, mesh2 = _meshes(args)
  bench = _Bench(args)
  results = {"rank": args.rank, "num_params": int(bench.num_params), "num_ranks": args.num_ranks,
             "leaf_shapes": [list(x.shape) for x in jax.tree.leaves(bench.shapes)],
             "iface": args.iface, "mesh": args.mesh, "modes": {}}
  if mesh2 is not None:
    results["mesh_process_ids"] = [[d.process_index for d in row] for row in mesh2.devices]
  modes = args.modes.split(",")
  hier_axis = ("node", "local")
  if "adam" in modes:  # on the 2-D mesh, pmean over both axes
    results["modes"]["adam"] = (_time_adam(bench, flat, "data") if mesh2 is None
                                else _time_adam(bench, mesh2, hier_axis))
  if "onebit" in modes or "onebit_compression" in modes:
    out = _time_onebit(bench, flat, "data", time_warmup="onebit" in modes)
    if "onebit" in modes:
      results["modes"]["onebit_warmup"] = out["warmup"]
    results["modes"]["onebit_compression"] = out["compression"]
  if "zero_one" in modes:
    hyper = dict(var_freeze_step=args.zo_freeze, var_update_scaler=args.zo_scaler,
                 local_steps=args.zo_local_steps or None,  # (0: no local steps)
                 local_step_scaler=args.zo_local_scaler)
    results["zero_one"] = _time_zero_one(bench, flat, "data", hyper, args.zo_steps, args.settle,
                                         args.zo_read_each_step)
  if "hier" in modes:
    out = _time_onebit(bench, mesh2, hier_axis, time_warmup=False)
    results["modes"]["hier_compression"] = dict(out["compression"],
                                                first_step_s=out["warmup"]["first_step_s"])

  if args.profile:
    results["profile"] = (_profile_collectives(args, flat, bench.shapes) if mesh2 is None
                          else _profile_hier(args, mesh2, flat, bench.shapes))

  with open(args.out, "w") as f:
    json.dump(results, f)
  if args.num_ranks > 1:
    jax.distributed.shutdown()


def _profile_collectives(args, mesh, shapes):
  """Times the collectives of one step on their own, with the optimizer's (core v3) sizes.

  Each is jitted under shard_map over all ranks and timed after compilation
  (median of --profile-repeats): the float32 psum of the unpadded gradient tree
  (1-bit Adam's warmup all-reduce, one tuple psum; Adam's pmean is the same
  bytes), the two uint8 collectives of the compression phase on the wire
  layout's messages (all_to_all of the (n, row_bytes) rows, all_gather of the
  server's row_bytes message), the whole 1-bit exchange (the rows built from
  per-leaf momenta: packed signs, per-leaf RMS scales, exact leaves as
  float32; all_to_all, the server's decode/average/re-compress, all_gather)
  on n ranks, and the compute pieces alone on one rank: building the rows,
  one server's work (decode the n rows of its chunk, average, re-compress) and
  the server of the whole vector on a 1-device layout.
  """
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  # The optimizer's wire layout, exchange and message packing (private API).
  from onebit_optax import _collective, _layout, _wire

  n = args.num_ranks
  leaf_shapes = tuple(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(shapes))
  layout = _layout.WireLayout(leaf_shapes, n)
  row = layout.row_bytes  # packed signs + float32 scales + float32 exact values
  sharded = NamedSharding(mesh, P("data"))

  def per_rank(shape, dtype, key):
    """(n, *shape), one slice per rank: inside shard_map, ``[0]`` is the rank's own."""
    fn = lambda: jax.random.normal(jax.random.key(key), (n,) + tuple(shape)).astype(dtype)
    return jax.jit(fn, out_shardings=sharded)()

  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  grads = [per_rank(shape, jnp.float32, 10 + i) for i, shape in enumerate(leaf_shapes)]
  rows = per_rank((n, row), jnp.uint8, 2)
  msg = per_rank((row,), jnp.uint8, 3)
  server_error = per_rank((1, layout.bits.chunk), jnp.float32, 4) * 0

  def encode(wl, leaves):
    """Phase 1's rows of the leaves, as the optimizer builds them (_onebit_adam._rows)."""
    sent = [leaves[i] for i in wl.compressed]
    scales = jnp.stack([_wire.leaf_rms(u) for u in sent])
    exact = (jnp.concatenate([jnp.ravel(leaves[i]) for i in wl.exact]) if wl.exact
             else jnp.zeros((0,), jnp.float32))
    return _wire.rows(wl, [_wire.leaf_signs(u) for u in sent], scales, exact)

  def exchange(gs, se):
    axes = _collective.resolve_axes("data", None, caller="profile")
    gathered, new_se, finite = _collective.onebit_exchange(
        encode(layout, [g[0] for g in gs]), se[0], layout, axes, keep_if_nonfinite=True)
    return gathered[None], new_se[None], finite[None]

  # Note: a collective whose result is unused is removed by XLA, so every result
  # is returned.
  psum = jax.jit(smap(lambda gs: [x[None] for x in jax.lax.psum([g[0] for g in gs], "data")]))
  a2a = jax.jit(smap(lambda r: jax.lax.all_to_all(r[0], "data", 0, 0, tiled=True)[None]))
  gather = jax.jit(smap(lambda m: jax.lax.all_gather(m[0], "data").reshape(-1)[None]))
  onebit = jax.jit(smap(exchange))
  # The compute pieces on this rank alone (no communication): building the rows
  # (every rank does it over the whole tree), the server of one chunk from n
  # rows (what each of the n servers does), and the server of the whole vector
  # (a 1-device cluster's, for the n = 1 end of benchmarks/scaling_model.py).
  layout_1 = _layout.WireLayout(leaf_shapes, 1)
  lgs = [jnp.asarray(np.asarray(g.addressable_data(0))[0]) for g in grads]
  encode_n = jax.jit(lambda gs: encode(layout, gs))

  def server(wl, received, se):
    served = _collective.serve(received, se, wl.bits, exact_chunk=wl.exact_chunk, chunk_index=0,
                               n_slow=received.shape[0])
    return served.message, served.residual
  serve_n = jax.jit(functools.partial(server, layout))
  serve_1 = jax.jit(functools.partial(server, layout_1))
  rows_n = jax.block_until_ready(encode_n(lgs))
  rows_1 = jax.block_until_ready(jax.jit(lambda gs: encode(layout_1, gs))(lgs))
  se_n = jnp.zeros((layout.bits.chunk,), jnp.float32)
  se_1 = jnp.zeros((layout_1.bits.chunk,), jnp.float32)
  cases = {
      "psum f32 of the gradient tree (warmup's all-reduce, unpadded)": lambda: psum(grads),
      f"all_to_all uint8 ({n}, {row}) (phase 1)": lambda: a2a(rows),
      f"all_gather uint8 of {row} B (phase 2)": lambda: gather(msg),
      "1-bit exchange (rows + all_to_all + server + all_gather), n ranks":
          lambda: onebit(grads, server_error),
      "rows alone (signs, leaf scales, exact floats of the tree; no communication)":
          lambda: encode_n(lgs),
      "server alone, one chunk from n rows (no communication)":
          lambda: serve_n(rows_n, se_n),
      "server alone, n=1: the whole vector (no communication)":
          lambda: serve_1(rows_1, se_1),
  }
  out = {}
  for name, fn in cases.items():
    jax.block_until_ready(fn())
    times = []
    for _ in range(args.profile_repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - t)
    out[name] = float(np.median(times))
  return out


def _profile_hier(args, mesh, flat, shapes):
  """Times the pieces of a hierarchical step on the 2-D mesh (rank 0, median of repeats).

  The float32 reduce-scatter over 'local' of the padded buffer (each device
  keeps its node's mean of a 1/L slice) and, for comparison, the float32
  all-reduce of the same buffer over 'local', the uint8 all_to_all and all_gather
  over 'node' and the uint8 all_gather over 'local' (message sizes as in the
  optimizer), one scalar psum over each axis (the latency of a collective on a
  sub-axis), compressed_mean over ('node', 'local') as a whole, and flat
  compressed_mean over 'data' on the 1-D mesh of the same ranks.
  """
  import functools

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import onebit_optax
  from onebit_optax import _collective, _layout  # the optimizer's flat layout (private)

  n, (nodes, local) = args.num_ranks, mesh.devices.shape
  layout = _layout.layout_for(shapes, n)
  d, ax = layout.padded, ("node", "local")
  row = layout.chunk // 8 + 4 * layout.max_segments  # packed signs + float32 scales

  def per_device(m, spec, shape, dtype, key):
    fn = lambda: jax.random.normal(jax.random.key(key), (n * shape[0],) + shape[1:]).astype(dtype)
    return jax.jit(fn, out_shardings=NamedSharding(m, spec))()

  smap = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(ax), out_specs=P(ax))
  x = per_device(mesh, P(ax), (d,), jnp.float32, 1)
  rows = per_device(mesh, P(ax), (nodes, row), jnp.uint8, 2)
  msg = per_device(mesh, P(ax), (row,), jnp.uint8, 3)
  big = per_device(mesh, P(ax), (nodes * row,), jnp.uint8, 4)
  one = per_device(mesh, P(ax), (1,), jnp.float32, 5)
  # Worker error: the device's 1/L slice; server error: one chunk.
  errs = (per_device(mesh, P(ax), (d // local,), jnp.float32, 6) * 0,
          per_device(mesh, P(ax), (layout.chunk,), jnp.float32, 7) * 0)
  hier = jax.jit(jax.shard_map(
      lambda v, e: (lambda m, a, b: (m[None], (a, b)))(
          *_collective.compressed_mean(v, e[0], e[1], ax, layout=layout)),
      mesh=mesh, in_specs=(P(ax), P(ax)), out_specs=(P(ax), P(ax))))
  fx = per_device(flat, P("data"), (d,), jnp.float32, 8)
  ferrs = (per_device(flat, P("data"), (d,), jnp.float32, 9) * 0,
           per_device(flat, P("data"), (layout.chunk,), jnp.float32, 10) * 0)
  flat_cm = jax.jit(jax.shard_map(
      lambda v, e: (lambda m, a, b: (m[None], (a, b)))(
          *_collective.compressed_mean(v, e[0], e[1], "data", layout=layout)),
      mesh=flat, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))))
  cases = {
      "psum_scatter f32 over 'local' (padded buffer)": (
          jax.jit(smap(lambda v: jax.lax.psum_scatter(v, "local", tiled=True))), (x,)),
      # The same sum as a full all-reduce (twice the bytes of a reduce-scatter).
      "psum f32 over 'local' (padded buffer)": (
          jax.jit(smap(lambda v: jax.lax.psum(v, "local"))), (x,)),
      "all_to_all uint8 over 'node'": (
          jax.jit(smap(lambda r: jax.lax.all_to_all(r, "node", 0, 0, tiled=True))), (rows,)),
      "all_gather uint8 over 'node'": (
          jax.jit(smap(lambda m: jax.lax.all_gather(m, "node").reshape(-1))), (msg,)),
      "all_gather uint8 over 'local'": (
          jax.jit(smap(lambda m: jax.lax.all_gather(m, "local").reshape(-1))), (big,)),
      "psum of one float over 'local'": (jax.jit(smap(lambda v: jax.lax.psum(v, "local"))), (one,)),
      "psum of one float over 'node'": (jax.jit(smap(lambda v: jax.lax.psum(v, "node"))), (one,)),
      "compressed_mean over ('node', 'local')": (hier, (x, errs)),
      "compressed_mean over 'data' (flat, same ranks)": (flat_cm, (fx, ferrs)),
  }
  return {name: _median_time(fn, fargs, args.profile_repeats) for name, (fn, fargs) in cases.items()}


def _median_time(fn, fargs, repeats: int) -> float:
  import jax
  import numpy as np
  jax.block_until_ready(fn(*fargs))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*fargs))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  sub = parser.add_subparsers(dest="cmd", required=True)
  srv = sub.add_parser("tcp-server")
  srv.add_argument("nbytes", type=int)
  cli = sub.add_parser("tcp-client")
  cli.add_argument("nbytes", type=int)
  cli.add_argument("host")
  rk = sub.add_parser("rank")
  rk.add_argument("--rank", type=int, required=True)
  rk.add_argument("--num-ranks", type=int, required=True)
  rk.add_argument("--coordinator", default=None)
  rk.add_argument("--iface", default="eth0")
  rk.add_argument("--vocab", type=int, required=True)
  rk.add_argument("--dim", type=int, required=True)
  rk.add_argument("--batch", type=int, required=True, help="sequences per rank")
  rk.add_argument("--seq", type=int, required=True)
  rk.add_argument("--steps", type=int, required=True, help="timed steps per repeat")
  rk.add_argument("--repeats", type=int, required=True)
  rk.add_argument("--modes", default="adam,onebit",
                  help="comma list of adam, onebit (warmup + compression), onebit_compression "
                       "(compression only), hier (hierarchical 1-bit Adam, needs --mesh), "
                       "zero_one (0/1 Adam, every phase)")
  d = ZERO_ONE_DEFAULTS
  rk.add_argument("--zo-freeze", type=int, default=d["var_freeze_step"])
  rk.add_argument("--zo-scaler", type=int, default=d["var_update_scaler"])
  rk.add_argument("--zo-local-steps", type=int, default=d["local_steps"])
  rk.add_argument("--zo-local-scaler", type=int, default=d["local_step_scaler"])
  rk.add_argument("--zo-steps", type=int, default=ZERO_ONE_STEPS)
  rk.add_argument("--settle", type=float, default=0.3,
                  help="seconds the 0/1 Adam run waits (untimed) before reading the counters at "
                       "a change of phase")
  rk.add_argument("--zo-read-each-step", action="store_true",
                  help="read each 0/1 step's phase on the host right after it (the old way)")
  rk.add_argument("--mesh", default=None,
                  help="NODESxLOCAL: also a 2-D ('node', 'local') mesh (adam then reduces over it)")
  rk.add_argument("--profile", action="store_true", help="also time the collectives alone")
  rk.add_argument("--profile-repeats", type=int, default=3)
  rk.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if args.cmd == "tcp-server":
    _tcp_server(args.nbytes)
  elif args.cmd == "tcp-client":
    _tcp_client(args.nbytes, args.host)
  else:
    _rank(args)


if __name__ == "__main__":
  sys.exit(main())
