"""A small reader for compiled HLO text: which collectives run, on what, and where.

The communication claims of 1-bit Adam are claims about the compiled program
(which collectives XLA emits, on which dtypes, in which branch of the phase
switch), so the tests read them off ``jax.jit(f).lower(...).compile()`` rather
than trusting the Python code that asked for them.

The shapes, replica groups and called computations are read from the HLO text
(the structured module that jaxlib exposes lists instructions and opcodes, but
not shapes on jax 0.10 nor replica groups or called computations on any
version). ``HloModule.from_compiled`` checks the text against that structured
module: every collective it lists must have been parsed, so a format change that
makes the text parser skip a line fails loudly instead of hiding a collective.
The replica groups come in three text formats, all read here:

- explicit, every version: ``replica_groups={{0,1,2,3},{4,5,6,7}}``;
- iota, ``[groups,size]<=[devices]``: ``replica_groups=[2,4]<=[8]``;
- mesh axes, jax >= 0.12: ``replica_groups=mesh['x'=2,'y'=4] {'y'}`` (the
  groups span the axes in braces: here 4 devices each).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Optional

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}

# Opcode (after dropping an async "-start" suffix) -> canonical collective name.
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
               "collective-permute", "collective-broadcast")

_CALLED_ATTR = re.compile(
    r"\b(?:to_apply|calls|body|condition|branch_computations|true_computation|"
    r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.dims)

  @property
  def nbytes(self) -> int:
    return self.size * _DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str  # as written, e.g. "all-gather" or "all-gather-start".
  shape: object  # an Array or a tuple of shapes (nested like the HLO tuple).
  computation: str  # the computation that holds this instruction.
  called: tuple[str, ...]  # computations it calls, in order (branches in branch order).
  group_size: Optional[int]  # devices per replica group, for collectives.
  line: str

  @property
  def collective(self) -> Optional[str]:
    """The canonical collective kind, or None for other instructions."""
    op = self.opcode[:-len("-start")] if self.opcode.endswith("-start") else self.opcode
    return op if op in COLLECTIVES else None

  @property
  def result_arrays(self) -> tuple[Array, ...]:
    """The arrays the collective produces on this device."""
    shape = self.shape
    # Async all-gather / collective-permute starts return (operands, results).
    if (self.opcode in ("all-gather-start", "collective-permute-start")
        and isinstance(shape, tuple) and len(shape) == 2):
      shape = shape[1]
    return tuple(_flatten(shape))

  @property
  def dtypes(self) -> frozenset[str]:
    return frozenset(a.dtype for a in self.result_arrays)

  @property
  def size(self) -> int:
    return sum(a.size for a in self.result_arrays)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.result_arrays)

  def wire_bytes(self, n: Optional[int] = None) -> float:
    """Bytes one device sends for this collective, in the ring model.

    all-reduce: 2 (n-1)/n of the buffer (reduce-scatter + all-gather);
    all-gather: (n-1)/n of the output; all-to-all: (n-1)/n of the buffer (the
    part that stays on the device does not travel); reduce-scatter: (n-1) times
    the output; collective-permute / broadcast: the whole buffer.
    """
    n = self.group_size if n is None else n
    kind, b = self.collective, self.nbytes
    if kind in ("collective-permute", "collective-broadcast"):
      return float(b)
    if n is None:
      raise ValueError(f"{self.name} does not say its group size; pass n: {self.line}")
    if kind == "all-reduce":
      return 2.0 * (n - 1) / n * b
    if kind in ("all-gather", "all-to-all"):
      return (n - 1) / n * b
    if kind == "reduce-scatter":
      return float((n - 1) * b)
    raise ValueError(f"{self.name} is not a collective ({self.opcode}).")

  def __str__(self):
    arrays = ", ".join(f"{a.dtype}{list(a.dims)}" for a in self.result_arrays)
    return f"{self.collective or self.opcode}({arrays}) in {self.computation}"


def _flatten(shape) -> Iterable[Array]:
  if isinstance(shape, Array):
    yield shape
  else:
    for s in shape:
      yield from _flatten(s)


def _parse_shape(text: str):
  """Parses a (possibly tuple) HLO shape at the start of ``text``; returns (shape, rest)."""
  text = text.lstrip()
  if text.startswith("("):
    elements, rest = [], text[1:]
    while True:
      rest = rest.lstrip()
      if rest.startswith(")"):
        return tuple(elements), rest[1:]
      element, rest = _parse_shape(rest)
      elements.append(element)
      rest = rest.lstrip()
      if rest.startswith(","):
        rest = rest[1:]
  m = re.match(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?", text)
  if not m:
    raise ValueError(f"cannot parse an HLO shape at: {text[:80]!r}")
  dims = tuple(int(d) for d in m.group(2).replace("<=", "").split(",") if d)
  return Array(m.group(1), dims), text[m.end():]


def _mesh_group_size(axes: str, group_axes: str, line: str) -> int:
  """Devices per group of ``mesh['x'=2,'y'=4] {'y'}``: the product of the braced axes' sizes."""
  sizes = {name: int(size) for name, size in re.findall(r"'([^']*)'\s*=\s*(\d+)", axes)}
  names = re.findall(r"'([^']*)'", group_axes)
  unknown = [n for n in names if n not in sizes]
  if unknown or not sizes:
    raise ValueError(f"replica_groups name axes {unknown} that the mesh {axes!r} lacks: {line}")
  return math.prod(sizes[n] for n in names)


def _group_size(line: str) -> Optional[int]:
  """Devices per replica group, from any of the three text formats (module docstring).

  Returns None for an instruction without groups, or with ``replica_groups={}``
  (one group of all devices, whose number the instruction does not say).
  Raises ValueError for a format this reader does not know, rather than
  guessing.
  """
  if "replica_groups=" not in line:
    return None
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # explicit: {{0,1,..},{..}}
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota: [groups,size]<=[...]
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # jax >= 0.12
  if m:
    return _mesh_group_size(m.group(1), m.group(2), line)
  if re.search(r"replica_groups=\{\}", line):
    return None
  raise ValueError(f"unknown replica_groups format in: {line}")


class HloModule:
  """The computations of a compiled HLO module and the instructions in each."""

  def __init__(self, text: str):
    self.text = text
    self.computations: dict[str, list[Instruction]] = {}
    self.entry: Optional[str] = None
    current = None
    for raw in text.splitlines():
      line = _COMMENT.sub("", raw)
      if not line.strip():
        continue
      if not line[0].isspace():
        header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header:
          current = header.group(2)
          self.computations[current] = []
          if header.group(1):
            self.entry = current
        elif line.startswith("}"):
          current = None
        continue
      if current is None:
        continue
      m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
      if not m:
        continue
      shape, rest = _parse_shape(m.group(2))
      op = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rest)
      if not op:
        continue
      called = []
      for attr in _CALLED_ATTR.finditer(rest):
        called += [c.strip().lstrip("%") for c in attr.group(1).strip("{}").split(",") if c.strip()]
      self.computations[current].append(Instruction(
          name=m.group(1), opcode=op.group(1), shape=shape, computation=current,
          called=tuple(called), group_size=_group_size(rest), line=raw.strip()))
    if self.entry is None:
      raise ValueError("no ENTRY computation in the HLO text")

  @classmethod
  def from_compiled(cls, compiled) -> "HloModule":
    """Reads ``compiled`` (a ``jax.stages.Compiled``), checked against its structured module."""
    module = cls(compiled.as_text())
    structured = _structured_collectives(compiled)
    if structured is not None:
      parsed = sorted((c, i.name, i.opcode) for c, instrs in module.computations.items()
                      for i in instrs if i.collective)
      if parsed != structured:
        raise AssertionError(
            "the HLO text parser and the compiled module disagree on the collectives: "
            f"parsed only {sorted(set(parsed) - set(structured))}, "
            f"module only {sorted(set(structured) - set(parsed))}")
    return module

  def instructions(self, computations: Iterable[str]) -> list[Instruction]:
    return [i for c in sorted(computations) for i in self.computations[c]]

  def reachable(self, roots: Iterable[str], skip: Iterable[str] = ()) -> set[str]:
    """Computations reachable from ``roots``, not following instructions named in ``skip``."""
    skip, seen, todo = set(skip), set(), list(roots)
    while todo:
      c = todo.pop()
      if c in seen:
        continue
      seen.add(c)
      for instr in self.computations[c]:
        if instr.name not in skip:
          todo += [x for x in instr.called if x in self.computations]
    return seen

  def collectives(self, computations: Iterable[str]) -> list[Instruction]:
    """Collectives in ``computations`` (async "-done" halves are not counted twice)."""
    return [i for i in self.instructions(computations) if i.collective]

  def distinct_kernels(self) -> int:
    """Fused computations that differ other than by their names: what XLA:CPU compiles.

    XLA:CPU emits one kernel per distinct fused computation (``optax.adam``'s
    program for 300 leaves of 20 shapes has 903 fusions and 63 kernels). A
    fusion that slices its leaf out of a shared buffer differs from every
    other leaf's, so it is compiled once per leaf. The compile time follows
    this count (and the kernels' size), not the number of fusions.
    """
    bodies = set()
    for instr in self.instructions(self.computations):
      if instr.opcode == "fusion":
        bodies.update(_normalized(self.computations[c]) for c in instr.called
                      if c in self.computations)
    return len(bodies)

  def conditionals(self) -> list[Instruction]:
    return [i for i in self.instructions(self.reachable([self.entry]))
            if i.opcode == "conditional"]


_NAME = re.compile(r"%[\w.\-]+")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def _normalized(instructions: list[Instruction]) -> str:
  """A computation's text with its names numbered in order of appearance, metadata dropped."""
  names: dict[str, str] = {}
  rename = lambda m: names.setdefault(m.group(0), f"%{len(names)}")
  return "\n".join(_NAME.sub(rename, _METADATA.sub("", i.line)) for i in instructions)


def _opcode(enum_value) -> str:
  """``HloOpcode.kAllGatherStart`` -> ``all-gather-start`` (the text's spelling)."""
  camel = str(enum_value).rsplit(".", 1)[-1].removeprefix("k")
  return re.sub(r"(?<!^)(?=[A-Z])", "-", camel).lower()


def _structured_collectives(compiled) -> Optional[list[tuple[str, str, str]]]:
  """(computation, instruction, opcode) of every collective in jaxlib's structured module.

  None where this jaxlib does not expose the instructions (``runtime_executable()``
  is a debugging API: jax 0.10.2 to 0.12 list them, jax 0.10.0 has no
  ``HloComputation.instructions``).
  """
  try:
    (hlo_module,) = compiled.runtime_executable().hlo_modules()
    found = []
    for comp in hlo_module.computations():
      for instr in comp.instructions():
        op = _opcode(instr.opcode)
        if (op[:-len("-start")] if op.endswith("-start") else op) in COLLECTIVES:
          found.append((comp.name, instr.name, op))
  except (AttributeError, TypeError, ValueError):
    return None
  return sorted(found)


@dataclasses.dataclass
class PhaseCollectives:
  """The collectives of a training step, split by the 1-bit Adam phase switch."""

  conditional: Instruction  # the conditional whose branch holds the all-to-all.
  conditionals: list[Instruction]  # every conditional whose branches communicate.
  warmup: list[Instruction]
  compression: list[Instruction]
  outside: list[Instruction]  # forward, backward and anything else outside the switch.


def split_by_phase(module: HloModule) -> PhaseCollectives:
  """Finds the phase switch (the conditionals whose branches communicate) and splits.

  The switch is a few conditionals on the same phase flag (each with one kind
  of full-size result, see onebit_optax._onebit_adam._switch); the compression
  collectives are those of the one branch holding an all-to-all, the warmup's
  those of the other communicating branches.
  """
  switches = []
  for cond in module.conditionals():
    per_branch = [module.collectives(module.reachable([b])) for b in cond.called]
    if any(per_branch):
      switches.append((cond, per_branch))
  with_a2a = [(cond, i) for cond, per_branch in switches for i, cs in enumerate(per_branch)
              if any(c.collective == "all-to-all" for c in cs)]
  if len(with_a2a) != 1:
    raise AssertionError(
        f"expected exactly one branch with an all-to-all, got {len(with_a2a)} among the "
        f"conditionals {[c.name for c, _ in switches]}")
  (switch, index), compression, warmup = with_a2a[0], [], []
  for cond, per_branch in switches:
    if len(per_branch) != 2:
      raise AssertionError(f"the conditional {cond.name} has {len(per_branch)} branches, not 2")
    for i, collectives in enumerate(per_branch):
      (compression if (cond is switch and i == index) else warmup).extend(collectives)
  outside = module.collectives(
      module.reachable([module.entry], skip=[cond.name for cond, _ in switches]))
  return PhaseCollectives(switch, [c for c, _ in switches], warmup, compression, outside)


def total_wire_bytes(collectives: Iterable[Instruction], n: Optional[int] = None) -> float:
  return sum(c.wire_bytes(n) for c in collectives)
