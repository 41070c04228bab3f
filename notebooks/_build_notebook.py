"""Writes onebit_adam_quickstart.ipynb from the cells below (run: python notebooks/_build_notebook.py).

The notebook is generated rather than edited by hand so that its source reviews
as plain Python, and the committed file stays stripped: no outputs, every
``execution_count`` None, fixed cell ids (a rebuild of unchanged cells gives
the same bytes; tests/test_notebook.py checks that).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parent / "onebit_adam_quickstart.ipynb"

CELLS = [
    ("markdown", r"""
# 1-bit Adam in JAX: a quickstart

[`onebit-optax`](../README.md) implements **1-bit Adam** (Tang et al., ICML 2021,
[arXiv:2102.02888](https://arxiv.org/abs/2102.02888)) as an Optax gradient transformation. After a
short warmup of ordinary Adam, data-parallel workers exchange **one bit per parameter** instead of a
float32, with Adam's convergence.

This notebook explains the idea, trains the same small model with `optax.adam` and
`onebit_optax.onebit_adam` on 8 data-parallel devices (8 simulated CPU devices when there is no
accelerator), plots what happens, and ends with the recipe for your own training loop.
It runs in about a minute on a laptop CPU.
"""),
    ("code", r"""
# Setup: onebit-optax is not on PyPI. Install it from a clone of the repository first:
# `pip install -e .` in its root (or `python3 dev.py env`, which installs it into .venv).
import importlib.util
import sys

if importlib.util.find_spec('onebit_optax') is None:
  raise ModuleNotFoundError(
      "onebit_optax is not installed (it is not on PyPI): in a clone of the repository run "
      "`pip install -e .`, then restart this notebook's kernel.")
print('python:', sys.executable)
"""),
    ("code", r"""
# Devices. XLA reads this flag once, when JAX creates its CPU backend, so it must be set before
# `import jax`. It only shapes the CPU backend: on a GPU/TPU runtime JAX keeps using the
# accelerators, and the 8 CPU devices are only a fallback for a single-accelerator runtime
# (one device has nobody to talk to, so there would be nothing to compress).
import os
if 'jax' in sys.modules:
  print('jax was imported before this cell: restart the kernel if you need the 8 CPU devices.')
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()

import functools
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import onebit_optax

accelerators = [d for d in jax.devices() if d.platform != 'cpu']
devices = accelerators if len(accelerators) >= 2 else jax.devices('cpu')
n = len(devices)
mesh = jax.make_mesh((n,), ('data',), devices=devices)
print(f'{n} {devices[0].platform} devices; jax {jax.__version__}, optax {optax.__version__}')
"""),
    ("markdown", r"""
## The idea in three paragraphs

**Why error feedback breaks Adam.** Compressing what workers send (here to its sign) loses
information; *error feedback* keeps the loss and adds it back next time:
$c_t = C(g_t + e_{t-1})$, $e_t = g_t + e_{t-1} - c_t$. Summed over steps the errors telescope,
$\sum_{t\le T} c_t = \sum_{t\le T} g_t - e_T$, so for SGD, whose update $-\eta\,c_t$ is *linear* in
what was sent, the parameters end up where uncompressed SGD would have put them, up to one bounded
$\eta e_T$. Adam's update $m_t / (\sqrt{v_t} + \epsilon)$ is not linear: an error stored at step $t$
is repaid at step $t'$ under a different scaling $1/\sqrt{v_{t'}}$, so the sum no longer telescopes.
Worse, $v$ is built from the compressed values themselves, whose squares are all equal to the
compression scale squared. Tang et al. show that Adam with error-compensated 1-bit compression of
the gradients does not match Adam's convergence.

**The frozen-variance fix.** The variance $v$ of Adam settles early in training, while the momentum
keeps moving. 1-bit Adam therefore runs plain Adam (one float32 all-reduce of the gradients per step)
for a warmup of $T_0$ steps, then **freezes** $v_{T_0}$. From then on the update
$m_t / (\sqrt{\hat v_{T_0}} + \epsilon)$ is momentum SGD under a fixed diagonal preconditioner:
linear in $m$ again, so error feedback works. Each worker $i$ folds its *local* gradient into the
momentum, $m_{i} = \beta_1 m_{t-1} + (1-\beta_1) g_{i,t}$, and the workers average these momenta with
a 1-bit compressed all-reduce. `variance_ratio_freeze` picks $T_0$: every $\Delta$ steps it
compares $\rho_t = \lVert\hat v_t\rVert_1 / \lVert\hat v_{t-\Delta}\rVert_1$ of the bias-corrected
variance and freezes once $\tau \le \rho_t \le 1/\tau$ (the paper's $\tau = 0.96$).

**The two-phase 1-bit all-reduce.** The compressor keeps one sign bit per element and one float32
scale, $C(x) = \frac{\lVert x\rVert_2}{\sqrt d}\,\mathrm{sign}(x)$. With $n$ workers, phase 1: worker
$i$ compresses $x_i + e_i$ and sends chunk $r$ of the packed signs to worker $r$ (an `all_to_all`).
Phase 2: worker $r$ averages the $n$ decoded copies of its chunk, adds its own *server error*,
re-compresses, and sends the result to everyone (an `all_gather`). Every worker decodes the same bits,
so replicas stay identical. Per worker, a ring all-reduce of float32 sends
$2\frac{n-1}{n}\cdot 4d \approx 8d$ bytes; the two phases send
$2(n-1)\big(\frac{d}{8n} + 4S\big) \approx \frac{d}{4}$ bytes: **32x fewer** (1 bit instead of 32).
Each leaf has its own scale (the RMS of the leaf), so a message carries one scale for each of the $S$
leaf pieces in its chunk; leaves with fewer than 64 elements (a small bias, a gate) travel as float32
inside the same messages and are averaged exactly.
"""),
    ("markdown", r"""
## Data and model

A character-level language model on the documentation text that ships with CPython
(`pydoc_data.topics`, ~465 kB, nothing to download): an MLP that reads the previous 8 characters and
predicts the next one. The first 90% of the text is for training, the rest for validation. Both
optimizers see exactly the same batches.
"""),
    ("code", r"""
from pydoc_data.topics import topics

text = ''.join(topics[key] for key in sorted(topics))
chars = sorted(set(text))
char_id = {c: i for i, c in enumerate(chars)}
ids = np.fromiter((char_id[c] for c in text), np.int32, len(text))
split = int(0.9 * len(ids))
train_ids, val_ids = ids[:split], ids[split:]

CONTEXT, VOCAB = 8, len(chars)
STEPS, BATCH = 600, 32 * n  # 32 sequences per device


def windows(data, starts):
  # Inputs: CONTEXT characters from each start; target: the character after them.
  w = data[starts[:, None] + np.arange(CONTEXT + 1)]
  return w[:, :-1], w[:, -1]


rng = np.random.default_rng(0)
batches = [windows(train_ids, rng.integers(0, len(train_ids) - CONTEXT - 1, BATCH))
           for _ in range(STEPS)]
val_x, val_y = windows(val_ids, rng.integers(0, len(val_ids) - CONTEXT - 1, 4096))


def init_params(key, embed=16, hidden=128):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      'embed': 0.1 * jax.random.normal(k1, (VOCAB, embed)),
      'w1': jax.random.normal(k2, (CONTEXT * embed, hidden)) / np.sqrt(CONTEXT * embed),
      'b1': jnp.zeros(hidden),
      'w2': jax.random.normal(k3, (hidden, VOCAB)) / np.sqrt(hidden),
      'b2': jnp.zeros(VOCAB),
  }


def loss_fn(params, x, y):
  h = params['embed'][x].reshape(x.shape[0], -1)
  h = jax.nn.relu(h @ params['w1'] + params['b1'])
  logits = h @ params['w2'] + params['b2']
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


params0 = init_params(jax.random.key(0))
num_params = sum(p.size for p in jax.tree.leaves(params0))
print(f'{len(text):,} characters, vocabulary {VOCAB}; {num_params:,} parameters; '
      f'global batch {BATCH} on {n} devices')
"""),
    ("markdown", r"""
## Adam vs 1-bit Adam, same data and schedule

One training step under `jax.shard_map`: every device computes the gradient of *its* shard of the
batch. `onebit_optax.local_params` marks the replicated parameters as per-device first; without it,
`jax.grad` would silently all-reduce the gradients in float32 in the backward pass. For Adam we then
average the gradients ourselves (`pmean`, the usual float32 all-reduce); 1-bit Adam takes the local
gradients and does its own communication. `init_sharded` works for any optax optimizer: only 1-bit
Adam's per-device buffers (what each device compressed last, its scales, the server error) are per
device, everything else is replicated.

Both use the same warmup-cosine learning rate and Optax's default $\beta_1, \beta_2$. 1-bit Adam
checks the variance every $\Delta = 50$ steps (the default, $1/(1-\beta_2) = 1000$, suits runs of
tens of thousands of steps, not this 600-step demo) and may freeze once the learning-rate warmup is
over.
"""),
    ("code", r"""
schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 50, STEPS, end_value=1e-3)
adam = optax.adam(schedule)
INTERVAL = 50  # Δ: steps between two checks of the variance ratio
freeze = onebit_optax.variance_ratio_freeze(min_steps=50, interval=INTERVAL)
onebit = onebit_optax.onebit_adam(schedule, axis_name='data', freeze=freeze)


def train(tx, *, is_onebit):
  # Returns per-step logs (loss, variance ratio, bytes sent per device) and the validation loss.
  params = jax.device_put(params0, NamedSharding(mesh, P()))  # replicated
  opt_state = onebit_optax.init_sharded(tx, params, mesh)
  specs = onebit_optax.state_partition_specs(opt_state, 'data')

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P('data'), P('data')),
                     out_specs=(P(), specs, P()))
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(onebit_optax.local_params(params, 'data'), x, y)
    if not is_onebit:
      grads = jax.lax.pmean(grads, 'data')  # Adam: float32 all-reduce of the gradients
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, 'data')

  logs = []
  start = time.perf_counter()
  for batch in batches:
    x, y = jax.device_put(batch, NamedSharding(mesh, P('data')))
    params, opt_state, loss = step(params, opt_state, x, y)
    # Fetching the logged values waits for the step. Besides logging, this keeps JAX from
    # queueing hundreds of steps ahead, which on simulated CPU devices can starve XLA's
    # collective rendezvous (it aborts after 40 s) on a busy machine.
    # The state's fields (found with optax.tree_utils.tree_get, also inside jit): the last
    # variance ratio and the bytes this device sent in the step.
    if is_onebit:
      get = functools.partial(optax.tree_utils.tree_get, opt_state)
      logs.append(jax.device_get((loss, get('variance_ratio'), get('wire_bytes'))))
    else:  # a float32 ring all-reduce: each device sends 2 (n-1)/n of the gradients
      logs.append((jax.device_get(loss), np.nan, 2 * (n - 1) / n * 4 * num_params))
  loss, ratio, sent = (np.asarray(v, np.float64) for v in zip(*logs))
  val_loss = float(loss_fn(jax.device_get(params), val_x, val_y))
  print(f'{"1-bit Adam" if is_onebit else "Adam":>10}: {STEPS} steps in '
        f'{time.perf_counter() - start:.1f} s, validation loss {val_loss:.4f}')
  return dict(loss=loss, ratio=ratio, bytes=sent, val_loss=val_loss, opt_state=opt_state)


adam_run = train(adam, is_onebit=False)
onebit_run = train(onebit, is_onebit=True)
status = onebit_optax.status(onebit_run['opt_state'], freeze)  # on the host, for logs
T0 = status.freeze_step or 0  # None: never froze
print(f'1-bit Adam froze the variance after step {T0} '
      f'(variance ratio {status.variance_ratio:.3f})')
"""),
    ("code", r"""
def smooth(v, k=25):
  return np.convolve(v, np.ones(k) / k, mode='valid')

steps = np.arange(1, STEPS + 1)
fig, (ax_loss, ax_ratio, ax_bytes) = plt.subplots(1, 3, figsize=(16, 4.2))

ax_loss.plot(steps[24:], smooth(adam_run['loss']), label='Adam')
ax_loss.plot(steps[24:], smooth(onebit_run['loss']), '--', label='1-bit Adam')
ax_loss.set(title='training loss (25-step mean)', xlabel='step', ylabel='cross-entropy (nats)')

# The ratio is measured every INTERVAL warmup steps (the first check only sets the reference).
checks = np.arange(INTERVAL, (T0 or STEPS) + 1, INTERVAL)
ax_ratio.plot(checks, onebit_run['ratio'][checks - 1], 'o-', color='C1', label='1-bit Adam')
ax_ratio.axhspan(0.96, 1 / 0.96, color='C2', alpha=0.2, label=r'freeze band $[\tau, 1/\tau]$')
ax_ratio.set(title=r'variance ratio $\|\hat v_t\|_1 / \|\hat v_{t-\Delta}\|_1$', xlabel='step',
             xlim=(0, STEPS))

ax_bytes.plot(steps, adam_run['bytes'], label='Adam (float32 ring all-reduce)')
ax_bytes.plot(steps, onebit_run['bytes'], '--', label='1-bit Adam')
ax_bytes.set(title='bytes sent per device per step', xlabel='step', yscale='log')
ax_bytes.text(STEPS, onebit_run['bytes'][-1] * 1.3,
              f"{adam_run['bytes'][-1] / onebit_run['bytes'][-1]:.1f}x fewer", ha='right')

for ax in (ax_loss, ax_ratio, ax_bytes):
  ax.axvline(T0, color='gray', ls=':', label=f'freeze (step {T0})')
  ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

total_adam, total_onebit = adam_run['bytes'].sum(), onebit_run['bytes'].sum()
print(f'bytes per device per step: Adam {adam_run["bytes"][-1]:,.0f}, '
      f'1-bit Adam after the freeze {onebit_run["bytes"][-1]:,.0f} '
      f'({adam_run["bytes"][-1] / onebit_run["bytes"][-1]:.1f}x fewer)')
print(f'bytes per device, whole run: Adam {total_adam:,.0f}, 1-bit Adam {total_onebit:,.0f} '
      f'({total_adam / total_onebit:.1f}x fewer, warmup included)')
print(f'validation loss: Adam {adam_run["val_loss"]:.4f}, 1-bit Adam {onebit_run["val_loss"]:.4f}')
"""),
    ("markdown", r"""
What to look at: until the freeze the two loss curves coincide (the warmup *is* Adam on the mean
gradient), and afterwards 1-bit Adam tracks Adam while each device sends about 1/32 of the bytes.
The whole-run saving is smaller because of the float32 warmup; in real runs the warmup is 15-25% of
training or less. On simulated CPU devices the wall time says nothing about the network (all
"devices" share one memory): the bytes are what a slow interconnect pays for.

## Use it in your own loop

The whole recipe, on a toy regression so that it runs on its own: replicate the parameters,
`init_sharded` the optimizer state, shard it with `state_partition_specs`, take gradients with
respect to `local_params`, and let `tx.update` do the communication. `onebit_optax.status` reads
any optimizer state that contains 1-bit Adam (or 0/1 Adam) on the host: the phase, the freeze step,
the bytes sent. For `jax.pmap` and multi-host training, see the docs:
[docs/getting_started.md](../docs/getting_started.md) (the pmap recipe) and
[docs/guides/multihost.md](../docs/guides/multihost.md).
"""),
    ("code", r"""
def my_loss(params, x, y):
  return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)

freeze = onebit_optax.fixed_step_freeze(20)
tx = onebit_optax.onebit_adam(5e-2, axis_name='data', freeze=freeze)
params = jax.device_put({'w': jnp.zeros((16, 1)), 'b': jnp.zeros(1)}, NamedSharding(mesh, P()))
opt_state = onebit_optax.init_sharded(tx, params, mesh)
specs = onebit_optax.state_partition_specs(opt_state, 'data')  # per-device buffers: P('data')

@jax.jit
@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P('data'), P('data')),
                   out_specs=(P(), specs, P()))
def train_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(my_loss)(onebit_optax.local_params(params, 'data'), x, y)
  updates, opt_state = tx.update(grads, opt_state, params)  # local grads in, averaged update out
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, 'data')

data_rng = np.random.default_rng(1)
w_true = data_rng.normal(size=(16, 1)).astype(np.float32)
for _ in range(100):
  x = data_rng.normal(size=(8 * n, 16)).astype(np.float32)
  batch = jax.device_put((x, x @ w_true), NamedSharding(mesh, P('data')))  # each device: its rows
  params, opt_state, loss = train_step(params, opt_state, *batch)
  loss = float(loss)  # log (and wait for the step: see the training loop above)
status = onebit_optax.status(opt_state, freeze)
print(f'recipe: loss {loss:.4f}, frozen={status.frozen} after step {status.freeze_step}, '
      f'{status.last_step_bytes:,.0f} bytes per device in the last step')
"""),
]


def build() -> nbformat.NotebookNode:
  """The notebook, stripped: no outputs, no execution counts, stable cell ids."""
  nb = nbformat.v4.new_notebook()
  nb.metadata = {
      "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                     "name": "python3"},
      "language_info": {"name": "python"},
      "colab": {"provenance": []},
  }
  for i, (kind, source) in enumerate(CELLS):
    make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
    cell = make(source.strip("\n"), id=f"cell-{i:02d}")
    nb.cells.append(cell)
  nbformat.validate(nb)
  return nb


def render() -> str:
  return nbformat.writes(build()) + "\n"


if __name__ == "__main__":
  NOTEBOOK.write_text(render())
  print(f"wrote {NOTEBOOK}", file=sys.stderr)
