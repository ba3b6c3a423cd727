"""What `aot` reports of each compiled program, from the compiler's numbers:
its memory on a chip against the chip's HBM, its flops and bytes, a roofline
step time, and each decode mode's step as a multiple of AR's. No compiler
here: the rows are made from plain numbers (tests build them by hand)."""

from __future__ import annotations

import json
import os
from typing import Optional

from flexdraft_jax.aot.chips import GIB, Chip
from flexdraft_jax.model.config import FlexDraftError

FORMAT = "flexdraft-aot-report"
JSON_FILE, MD_FILE = "aot_report.json", "aot_report.md"
MEMORY_KEYS = ("argument", "output", "alias", "temp", "generated_code")
EXIT_OK, EXIT_PROBLEM = 0, 2
DECODE_KINDS = ("ar", "parallel", "sequential", "tree")


def first_line(error) -> str:
  """The first non-empty line of an exception's message (or of a string); an
  exception other than the compiler's own is named (`KeyError: 'x'`)."""
  line = next((x.strip() for x in str(error).splitlines() if x.strip()), "")
  if isinstance(error, BaseException) and type(error).__name__ not in COMPILER_ERRORS:
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
  return line


# What XLA and its compilers raise (their messages start with a status: INTERNAL: …).
COMPILER_ERRORS = ("JaxRuntimeError", "XlaRuntimeError", "MosaicError")


def program_row(name: str, mode: str, batch: int, *, chip: Chip, devices_per_chip: int = 1,
                padded_batch: Optional[int] = None, memory: Optional[dict] = None,
                cost: Optional[dict] = None, error=None, seconds: float = 0.0) -> dict:
  """One program's row. `memory`: per device, in bytes, `MEMORY_KEYS` (the
  compiler's memory analysis); `cost`: per device, `flops` and
  `bytes_accessed` (its cost analysis); `error`: the compiler's refusal
  (its first line is kept). The chip's share of a program is its devices'
  (`devices_per_chip`: 2 where a chip's two cores are two devices, as on v4)."""
  row = {"name": name, "mode": mode, "batch": batch,
         "padded_batch": batch if padded_batch is None else padded_batch,
         "compiled": error is None, "error": None if error is None else first_line(error),
         "compile_seconds": round(seconds, 3), "chip_bytes": chip.hbm_bytes,
         "memory": None, "bytes_per_chip": None, "fits": None, "flops": None,
         "bytes_accessed": None, "predicted_step_seconds": None, "bound": None,
         "vs_ar": None}
  if error is not None:
    if out_of_memory(row["error"]):
      row["fits"] = False
    return row
  mem = {k: int(memory.get(k, 0)) for k in MEMORY_KEYS}
  row["memory"] = mem
  # A donated argument's buffer is the output it aliases: counted once.
  per_device = (mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
                + mem["generated_code"])
  row["bytes_per_chip"] = per_device * devices_per_chip
  row["fits"] = row["bytes_per_chip"] <= chip.hbm_bytes
  flops = float(cost.get("flops", 0.0)) * devices_per_chip
  moved = float(cost.get("bytes_accessed", 0.0)) * devices_per_chip
  row["flops"], row["bytes_accessed"] = flops, moved
  memory_s, compute_s = moved / chip.hbm_bytes_per_s, flops / chip.peak_bf16_flops
  row["predicted_step_seconds"] = max(memory_s, compute_s)
  row["bound"] = "memory" if memory_s >= compute_s else "compute"
  return row


def out_of_memory(line: str) -> bool:
  """Whether a compiler's refusal says the program does not fit in HBM."""
  low = (line or "").lower()
  return "resource_exhausted" in low or "out of memory" in low


def with_ar_ratios(rows: list) -> list:
  """Each decode chunk's predicted step as a multiple of AR's chunk at the
  same batch (`vs_ar`; None where either did not compile)."""
  ar = {r["batch"]: r["predicted_step_seconds"] for r in rows
        if r["mode"] == "ar" and r["predicted_step_seconds"]}
  for r in rows:
    base = ar.get(r["batch"])
    if r["mode"].split(":")[0] in DECODE_KINDS and base and r["predicted_step_seconds"]:
      r["vs_ar"] = r["predicted_step_seconds"] / base
  return rows


def problems(rows: list) -> list:
  """One line per program that did not compile or does not fit."""
  out = []
  for r in rows:
    if r["fits"] is False and r["bytes_per_chip"] is not None:
      out.append(f"{r['name']} does not fit: it needs {_gib(r['bytes_per_chip'])} a chip, "
                 f"the chip has {_gib(r['chip_bytes'])}")
    elif r["fits"] is False:
      out.append(f"{r['name']} does not fit ({_gib(r['chip_bytes'])} a chip): {r['error']}")
    elif not r["compiled"]:
      out.append(f"{r['name']} did not compile: {r['error']}")
  return out


def exit_status(rows: list) -> int:
  return EXIT_PROBLEM if problems(rows) else EXIT_OK


def _gib(n) -> str:
  return f"{n / GIB:.2f} GiB"


def _num(x, scale: float, fmt: str) -> str:
  return "–" if x is None else format(x / scale, fmt)


def markdown(report: dict) -> str:
  """The report as a markdown page: what was compiled for what, then a row a
  program."""
  chip = report["chip"]
  lines = [
      f"# Compiled ahead of time: {report['target']} on {report['topology']}", "",
      f"Target `{report['target']}` ({report['dtype']}), drafter `{report['drafter']}`, "
      f"attention `{report['attn_impl']}`"
      + (f" ({report['attention']})" if report.get("attention", report["attn_impl"])
         != report["attn_impl"] else "")
      + f", cache {report['max_len']} positions, prompts padded to {report['prompt_len']}; "
      f"{report['devices']} device{'s' if report['devices'] > 1 else ''} "
      f"({report['devices_per_chip']} a chip). Compiled by JAX {report['versions']['jax']}"
      f", libtpu {report['versions'].get('libtpu') or '?'}, with no accelerator attached.",
      "",
      f"{chip['name']}: {_gib(chip['hbm_bytes'])} HBM at {chip['hbm_bytes_per_s'] / 1e9:.0f}"
      f" GB/s, {chip['peak_bf16_flops'] / 1e12:.0f} TFLOP/s bf16 a chip ({chip['source']}).",
      "Memory is the compiler's (arguments + outputs − donated + temporaries + code, a "
      "chip's devices together); flops and bytes its cost analysis (a decode chunk's loop "
      "body: one step); predicted step = max(bytes / bandwidth, flops / peak).", "",
      "| program | mode | batch | compiled | memory a chip | of HBM | fits | GFLOP | "
      "MB accessed | predicted step | × AR |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["programs"]:
    share = None if r["bytes_per_chip"] is None else r["bytes_per_chip"] / r["chip_bytes"]
    step = r["predicted_step_seconds"]
    lines.append(
        f"| {r['name']} | {r['mode']} | {r['batch']}"
        + (f" ({r['padded_batch']} rows)" if r["padded_batch"] != r["batch"] else "") + " | "
        + ("yes" if r["compiled"] else f"no: {r['error']}".replace("|", "/"))
        + f" | {_num(r['bytes_per_chip'], 2 ** 20, '.1f')} MiB | "
        f"{'–' if share is None else format(share, '.1%')} | "
        f"{'–' if r['fits'] is None else ('yes' if r['fits'] else '**no**')} | "
        f"{_num(r['flops'], 1e9, '.3f')} | {_num(r['bytes_accessed'], 1e6, '.2f')} | "
        f"{'–' if step is None else format(step * 1e6, '.1f') + ' µs'}"
        f"{'' if r['bound'] is None else ' (' + r['bound'] + ')'} | "
        f"{_num(r['vs_ar'], 1, '.2f')} |")
  bad = problems(report["programs"])
  if bad:
    lines += ["", "Problems:", ""] + [f"- {line}" for line in bad]
  return "\n".join(lines) + "\n"


def check_out(path: str) -> str:
  """`--out` as an absolute path: a new or empty folder, or one holding only
  an earlier report of this command (which is replaced); anything else is
  refused in one line, before any compiling."""
  if not path:
    raise FlexDraftError("--out is required (a new folder for the report)")
  full = os.path.abspath(os.path.expanduser(path))
  if os.path.lexists(full) and not os.path.isdir(full):
    raise FlexDraftError(f"--out {path} is a file, not a folder")
  if os.path.isdir(full):
    entries = set(os.listdir(full))
    if entries and not (entries <= {JSON_FILE, MD_FILE} and _is_ours(full)):
      raise FlexDraftError(f"--out {path} holds files this command did not write: "
                           "give a new folder")
  parent = full
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise FlexDraftError(f"--out {path}: a file is in the way ({parent} is not a folder)")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise FlexDraftError(f"--out {path} cannot be written: {parent} is not writable")
  return full


def _is_ours(folder: str) -> bool:
  try:
    with open(os.path.join(folder, JSON_FILE), encoding="utf-8") as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def write(folder: str, report: dict) -> tuple:
  """Writes the report's JSON and markdown into `folder` (made if missing),
  each atomically; returns their paths."""
  os.makedirs(folder, exist_ok=True)
  paths = []
  for name, text in ((JSON_FILE, json.dumps(report, indent=1) + "\n"),
                     (MD_FILE, markdown(report))):
    path = os.path.join(folder, name)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
    paths.append(path)
  return tuple(paths)
