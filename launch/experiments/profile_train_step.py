"""Where a drafter training step's time goes, op by op (jax.profiler on XLA:CPU).

  PYTHONPATH=. python launch/experiments/profile_train_step.py --config configs/smollm2_135m.py \
      --config.drafter.num_layers=8 --config.train.precompute_kv=False \
      --config.train.batch_size=4 --config.train.anchors_per_seq=64 --steps=2

Builds the trainer as `train` does (`bench_train.py`'s setup) and profiles
`--steps` steps of one width (the most common of the first 64 steps: one
compiled module), after an untimed one (the compile), under `jax.profiler.trace`. XLA:CPU records each executed HLO op (a "thunk"); their
durations are summed per op and attributed through the compiled module's
metadata to the innermost function of this package that emitted the op (e.g.
`transformer._mlp`), to the pass (forward, or the backward: JAX's `transpose`)
and to the op's kind. Ops may overlap on the 2 cores, so the shares are of the
summed op time, printed next to the wall time of the steps.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 2, "profiled steps", lower_bound=1)
flags.DEFINE_integer("top", 25, "rows of each table")
flags.DEFINE_string("trace_dir", "", "keep the trace here (default: a temporary folder)")

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][a-z\-]*)\(")
_META = re.compile(r"metadata=\{([^}]*)\}")


def hlo_index(text: str) -> dict:
  """{instruction name: (opcode, op_name, function chain, loop)} of a compiled
  module's text; the chain lists the innermost frame first, as `file:function`;
  `loop` names the while instruction whose body holds it (else None)."""
  files, funcs, locs, frames = {}, {}, {}, {}
  section = None
  for line in text.splitlines():
    head = line.strip()
    if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = head
      continue
    if section and not head.startswith(("%", "ENTRY", "HloModule")) and head:
      num, _, rest = head.partition(" ")
      if section == "FileNames":
        files[num] = rest.strip('"')
      elif section == "FunctionNames":
        funcs[num] = rest.strip('"')
      else:
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        (locs if section == "FileLocations" else frames)[num] = fields
      continue
    section = None

  def chain(frame_id):
    out, seen = [], set()
    while frame_id and frame_id not in seen:
      seen.add(frame_id)
      frame = frames.get(frame_id, {})
      loc = locs.get(frame.get("file_location_id"), {})
      name = os.path.basename(files.get(loc.get("file_name_id"), "?"))
      out.append(f"{name}:{funcs.get(loc.get('function_name_id'), '?')}")
      parent = frame.get("parent_frame_id")
      frame_id = None if parent == frame_id else parent
    return out

  # Instructions of while-loop bodies (a scan's layers) are tagged with the loop.
  body_of = {b: w for w, b in re.findall(r"%([\w.\-]+) = .*? while\(.*?body=%([\w.\-]+)",
                                         text)}
  index, computation = {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
    if head:
      computation = head.group(1)
    m = _INSTR.match(line)
    if not m:
      continue
    meta = _META.search(line)
    meta = meta.group(1) if meta else ""
    op_name = re.search(r'op_name="([^"]*)"', meta)
    frame = re.search(r"stack_frame_id=(\d+)", meta)
    op_name, frame = (op_name.group(1) if op_name else ""), frame and frame.group(1)
    index[m.group(1)] = (m.group(2), op_name, chain(frame), body_of.get(computation))
  return index


def own_function(chain: list, package_files=frozenset()) -> str:
  """The innermost frame in one of `package_files` (the library's modules, by
  file name), else the innermost one."""
  ours = [c for c in chain if not c.startswith(("api.py", "ad.py", "<"))]
  pkg = [c for c in ours if c.split(":")[0] in package_files]
  return (pkg or ours or chain or ["?"])[0]


def thunk_events(trace_dir: str, module_prefix: str) -> list:
  """(hlo_op, microseconds) of every op of modules named `module_prefix*`."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                          recursive=True))[-1]
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return [(e["args"]["hlo_op"], float(e.get("dur", 0.0))) for e in events
          if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
          and e["args"].get("hlo_module", "").startswith(module_prefix)]


def table(totals: dict, grand: float, steps: int, top: int) -> list:
  rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
  return [{"what": k, "ms_per_step": round(v / 1e3 / steps, 1),
           "share": round(v / grand, 3)} for k, v in rows]


def main(argv):
  del argv
  import jax

  import flexdraft_jax
  from flexdraft_jax.training import sharding, train

  root = os.path.dirname(flexdraft_jax.__file__)
  package_files = {os.path.basename(p) for p in
                   glob.glob(os.path.join(root, "**", "*.py"), recursive=True)}
  config = FLAGS.config
  tc = config.train
  su = train.setup(config, None)
  state, target_params, packer, (train_step, _), mesh = (
      su.state, su.target_params, su.packers.train, su.steps, su.mesh)
  rows = sharding.local_rows(tc.batch_size)
  # One compiled step (op names are per module): the steps of the most common
  # width among the first 64, the first of them run once untimed (the compile).
  widths = [packer.step_width(step, tc.batch_size) for step in range(64)]
  width = max(set(widths), key=widths.count)
  steps = [step for step, w in enumerate(widths) if w == width][:FLAGS.steps + 1]
  batch = None

  def step_once(step):
    nonlocal state, batch
    host = packer.train_batch(step, tc.batch_size, rows)
    batch = sharding.put_batch(host, mesh, tc.batch_size)
    state, m = train_step(state, target_params, batch)
    jax.block_until_ready(m)

  step_once(steps[0])
  trace_dir = FLAGS.trace_dir or tempfile.mkdtemp(prefix="train_profile_")
  t0 = time.perf_counter()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for step in steps[1:]:
      step_once(step)
  wall = time.perf_counter() - t0

  text = train_step.lower(state, target_params, batch).compile().as_text()
  with open(os.path.join(trace_dir, "train_step.hlo.txt"), "w") as f:
    f.write(text)
  index = hlo_index(text)
  by_fn, by_pass, by_kind, by_op = (collections.Counter() for _ in range(4))
  events = thunk_events(trace_dir, "jit_train_step")
  for op, us in events:
    kind, op_name, chain, loop = index.get(op, ("?", "", [], None))
    fn = own_function(chain, package_files)
    part = "backward" if "transpose(" in op_name else "forward"
    if loop:
      part += f" in loop {loop} ({index.get(loop, ('', '', ['?']))[2][0]})"
    by_fn[fn] += us
    by_pass[part] += us
    by_kind[kind] += us
    by_op[f"{op} ({kind}; {fn})"] += us
  grand = sum(us for _, us in events) or 1.0
  n, top = len(steps) - 1, FLAGS.top
  print(json.dumps({
      "width": width, "steps": steps[1:],
      "wall_s_per_step": round(wall / n, 3),
      "op_s_per_step": round(grand / 1e6 / n, 3),
      "ops_per_step": len(events) // n,
      "trace_dir": trace_dir,
      "by_pass": table(by_pass, grand, n, top),
      "by_function": table(by_fn, grand, n, top),
      "by_kind": table(by_kind, grand, n, top),
      "by_op": table(by_op, grand, n, top)}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
  import sys

  from flexdraft_jax.cli_util import define_flags
  define_flags(sys.argv)
  app.run(main)
