"""Writes the intersphinx inventories the docs ship (``python docs/_inventories/make_inventories.py``).

The build runs offline, so it cannot download the ``objects.inv`` of jax, optax,
flax, orbax and numpy. These are written here instead: for each library, the
names our pages and signatures reference, each with the address of its entry
in the library's published docs (the layout of each site: autosummary pages,
or anchors on one API page). A name missing here is a build error where a
page links it (the build is nitpicky): add it to TABLE and rerun this script.
"""

from __future__ import annotations

import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# library: (docs root, {page: [(name, role), ...]}); a page ending in "/" is one
# page per name (NAME.html), otherwise one page with an anchor per name.
_JAX_AUTOSUMMARY = [
    ("jax.Array", "class"), ("jax.ShapeDtypeStruct", "class"),
    ("jax.jit", "function"), ("jax.grad", "function"), ("jax.value_and_grad", "function"),
    ("jax.pmap", "function"), ("jax.shard_map", "function"), ("jax.make_mesh", "function"),
    ("jax.device_put", "function"), ("jax.device_get", "function"),
    ("jax.block_until_ready", "function"), ("jax.eval_shape", "function"),
    ("jax.devices", "function"), ("jax.local_devices", "function"),
    ("jax.device_count", "function"), ("jax.local_device_count", "function"),
    ("jax.process_count", "function"), ("jax.default_backend", "function"),
    ("jax.make_array_from_process_local_data", "function"),
    ("jax.distributed.initialize", "function"),
    ("jax.tree.map", "function"), ("jax.tree.leaves", "function"),
    ("jax.tree.structure", "function"), ("jax.tree.unflatten", "function"),
    ("jax.tree.flatten", "function"), ("jax.tree_util.keystr", "function"),
    ("jax.tree_util.tree_leaves_with_path", "function"),
    ("jax.tree_util.tree_flatten_with_path", "function"),
    ("jax.lax.psum", "function"), ("jax.lax.pmean", "function"), ("jax.lax.pmax", "function"),
    ("jax.lax.pmin", "function"), ("jax.lax.psum_scatter", "function"),
    ("jax.lax.all_gather", "function"), ("jax.lax.all_to_all", "function"),
    ("jax.lax.axis_index", "function"), ("jax.lax.cond", "function"),
    ("jax.lax.switch", "function"), ("jax.lax.scan", "function"),
    ("jax.lax.bitcast_convert_type", "function"),
    ("jax.random.key", "function"), ("jax.random.split", "function"),
    ("jax.random.normal", "function"), ("jax.nn.relu", "function"), ("jax.nn.gelu", "function"),
    ("jax.numpy.where", "function"), ("jax.numpy.zeros", "function"),
    ("jax.numpy.ones", "function"), ("jax.numpy.asarray", "function"),
    ("jax.numpy.array", "function"), ("jax.numpy.sum", "function"),
    ("jax.numpy.mean", "function"), ("jax.numpy.sqrt", "function"),
    ("jax.numpy.packbits", "function"), ("jax.numpy.concatenate", "function"),
    ("jax.numpy.stack", "function"), ("jax.numpy.isfinite", "function"),
]
TABLE = {
    "jax": ("https://docs.jax.dev/en/latest/", {
        "_autosummary/": _JAX_AUTOSUMMARY,
        "jax.sharding.html": [("jax.sharding.Mesh", "class"),
                              ("jax.sharding.NamedSharding", "class"),
                              ("jax.sharding.PartitionSpec", "class")],
    }),
    "optax": ("https://optax.readthedocs.io/en/latest/", {
        "api/optimizers.html": [("optax.adam", "function"), ("optax.adamw", "function"),
                                ("optax.sgd", "function")],
        "api/transformations.html": [
            ("optax.GradientTransformation", "class"),
            ("optax.GradientTransformationExtraArgs", "class"),
            ("optax.OptState", "class"), ("optax.Params", "class"),
            ("optax.Updates", "class"), ("optax.EmptyState", "class"),
            ("optax.add_decayed_weights", "function"), ("optax.clip_by_global_norm", "function"),
            ("optax.identity", "function"), ("optax.init_empty_state", "function"),
            ("optax.scale", "function"), ("optax.scale_by_adam", "function"),
            ("optax.scale_by_learning_rate", "function"), ("optax.set_to_zero", "function"),
            ("optax.trace", "function")],
        "api/optimizer_wrappers.html": [("optax.apply_if_finite", "function"),
                                        ("optax.masked", "function"),
                                        ("optax.MultiSteps", "class")],
        "api/combining_optimizers.html": [("optax.chain", "function"),
                                          ("optax.partition", "function")],
        "api/apply_updates.html": [("optax.apply_updates", "function")],
        # Documented under optax.schedules (its anchor), exported as optax.NAME too.
        "api/optimizer_schedules.html": [
            ("optax.inject_hyperparams", "function", "optax.schedules.inject_hyperparams"),
            ("optax.warmup_cosine_decay_schedule", "function",
             "optax.schedules.warmup_cosine_decay_schedule")],
        "api/losses.html": [("optax.softmax_cross_entropy_with_integer_labels", "function",
                             "optax.losses.softmax_cross_entropy_with_integer_labels")],
    }),
    "flax": ("https://flax.readthedocs.io/en/latest/", {
        "api_reference/flax.nnx/training/optimizer.html": [
            ("flax.nnx.Optimizer", "class", "flax.nnx.optimizer.Optimizer")],
        "api_reference/flax.nnx/transforms.html": [
            ("flax.nnx.shard_map", "function"), ("flax.nnx.grad", "function"),
            ("flax.nnx.jit", "function")],
        "api_reference/flax.nnx/graph.html": [
            ("flax.nnx.split", "function"), ("flax.nnx.merge", "function"),
            ("flax.nnx.state", "function")],
        "api_reference/flax.nnx/state.html": [("flax.nnx.State", "class")],
        "api_reference/flax.nnx/module.html": [("flax.nnx.Module", "class")],
        "api_reference/flax.nnx/variables.html": [("flax.nnx.Param", "class")],
        "api_reference/flax.nnx/rnglib.html": [("flax.nnx.Rngs", "class")],
        "api_reference/flax.nnx/nn/linear.html": [("flax.nnx.Linear", "class"),
                                                  ("flax.nnx.Embed", "class")],
    }),
    "orbax": ("https://orbax.readthedocs.io/en/latest/", {
        "api_reference/checkpoint.checkpoint_manager.html": [
            ("orbax.checkpoint.CheckpointManager", "class"),
            ("orbax.checkpoint.CheckpointManagerOptions", "class")],
        "api_reference/checkpoint.args.html": [
            ("orbax.checkpoint.args.Composite", "class"),
            ("orbax.checkpoint.args.PyTreeSave", "class"),
            ("orbax.checkpoint.args.PyTreeRestore", "class"),
            ("orbax.checkpoint.args.JsonSave", "class"),
            ("orbax.checkpoint.args.JsonRestore", "class")],
        "api_reference/checkpoint.checkpointers.html": [
            ("orbax.checkpoint.StandardCheckpointer", "class")],
    }),
    "numpy": ("https://numpy.org/doc/stable/", {
        "reference/generated/": [
            ("numpy.ndarray", "class"), ("numpy.dtype", "class"), ("numpy.asarray", "function"),
            ("numpy.shape", "function"), ("numpy.prod", "function"), ("numpy.arange", "function"),
            ("numpy.zeros", "function"), ("numpy.where", "function"), ("numpy.sqrt", "function"),
            ("numpy.isfinite", "function"), ("numpy.mean", "function"),
            ("numpy.packbits", "function")],
        "reference/arrays.scalars.html": [
            ("numpy.number", "class"), ("numpy.bool", "class"), ("numpy.bool_", "class"),
            ("numpy.integer", "class"), ("numpy.floating", "class"), ("numpy.generic", "class"),
            ("numpy.float32", "class")],
        "reference/random/generator.html": [("numpy.random.default_rng", "function"),
                                            ("numpy.random.Generator", "class")],
    }),
}


def entries(library: str) -> list[str]:
  """The inventory's lines: ``name py:role 1 uri -`` (uri relative to the docs root)."""
  _, pages = TABLE[library]
  lines = []
  for page, names in pages.items():
    for name, role, *anchor in names:
      anchor = anchor[0] if anchor else name
      uri = f"{page}{name}.html#{anchor}" if page.endswith("/") else f"{page}#{anchor}"
      lines.append(f"{name} py:{role} 1 {uri} -")
  return sorted(lines)


def inventory(library: str) -> bytes:
  """The ``objects.inv`` bytes (Sphinx inventory version 2) of ``library``."""
  header = (f"# Sphinx inventory version 2\n# Project: {library}\n# Version: \n"
            "# The remainder of this file is compressed using zlib.\n")
  body = "".join(line + "\n" for line in entries(library))
  return header.encode() + zlib.compress(body.encode(), 9)


def main() -> None:
  for library in TABLE:
    (HERE / f"{library}.inv").write_bytes(inventory(library))


if __name__ == "__main__":
  main()
