"""`python -m flexdraft_jax aot`: decode and training programs compiled for a TPU
slice that is not attached, and the report of what each needs.

The report's logic (fits, roofline, × AR, problems, exit status), the topology
table and the command's refusals need no compiler and always run. The tests
that compile need the TPU compiler (libtpu, `pip install "jax[tpu]"`) and skip
without it; they compile a tiny random target's programs with the Pallas
kernels for one v5e chip (seconds each), and show that a kernel Mosaic refuses
lowers to text and fails only when compiled.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from flexdraft_jax.aot import chips, programs, report
from flexdraft_jax.aot.chips import GIB
from flexdraft_jax.model.config import FlexDraftError

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_tpu_compiler = pytest.mark.skipif(
    not HAS_LIBTPU, reason='the TPU compiler is not installed: pip install "jax[tpu]"')
V5E = chips.CHIPS["v5e"]
TINY = ["--target=random:tiny", "--drafter=random:L=2,block=4", "--topology=v5e:1x1",
        "--max_len=256", "--prompt_len=64", "--modes=ar,sequential:4"]


def _row(name, mode, batch, memory=None, flops=0.0, moved=0.0, **kw):
  cost = {"flops": flops, "bytes_accessed": moved}
  return report.program_row(name, mode, batch, chip=V5E, memory=memory, cost=cost, **kw)


# ------------------------------------------------ no compiler needed ----

def test_a_row_adds_up_the_compilers_memory_and_takes_the_roofline():
  mem = dict(argument=3 * GIB, output=2 * GIB, alias=2 * GIB, temp=GIB, generated_code=1024)
  r = _row("chunk ar B=1", "ar", 1, mem, flops=197e9, moved=8.19e9)
  # the donated output is its argument's buffer: counted once
  assert r["bytes_per_chip"] == 4 * GIB + 1024
  assert r["chip_bytes"] == 16 * GIB and r["fits"] is True and r["compiled"]
  assert r["predicted_step_seconds"] == pytest.approx(0.01)  # 8.19 GB at 819 GB/s
  assert r["bound"] == "memory"
  compute = _row("prefill B=1", "prefill", 1, mem, flops=197e12, moved=8.19e9)
  assert compute["predicted_step_seconds"] == pytest.approx(1.0)
  assert compute["bound"] == "compute"


def test_a_chips_two_devices_count_twice_against_its_memory():
  mem = dict(argument=20 * GIB, output=0, alias=0, temp=0, generated_code=0)
  one = report.program_row("x", "ar", 1, chip=chips.CHIPS["v4"], memory=mem, cost={})
  two = report.program_row("x", "ar", 1, chip=chips.CHIPS["v4"], devices_per_chip=2,
                           memory=mem, cost={})
  assert one["fits"] and one["bytes_per_chip"] == 20 * GIB
  assert not two["fits"] and two["bytes_per_chip"] == 40 * GIB  # of v4's 32


def test_what_does_not_fit_or_compile_is_one_line_each_and_fails_the_exit_status():
  small = dict(argument=GIB, output=0, alias=0, temp=0, generated_code=0)
  big = dict(argument=15 * GIB, output=0, alias=0, temp=2 * GIB, generated_code=0)
  rows = report.with_ar_ratios([
      _row("chunk ar B=1", "ar", 1, small, moved=1e6),
      _row("chunk sequential:8 B=1", "sequential:8", 1, small, moved=3e6),
      _row("chunk parallel:4 B=16", "parallel:4", 16, big, moved=1e6),
      _row("chunk tree:16 B=16", "tree:16", 16,
           error="INTERNAL: Mosaic failed to compile TPU kernel: x\nmore"),
      _row("prefill B=16", "prefill", 16,
           error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.1G "
                 "of 15.75G hbm.\ndetails")])
  assert [r["vs_ar"] for r in rows] == [1.0, pytest.approx(3.0), None, None, None]
  assert report.exit_status(rows[:2]) == report.EXIT_OK
  assert report.exit_status(rows) == report.EXIT_PROBLEM
  assert rows[3]["error"] == "INTERNAL: Mosaic failed to compile TPU kernel: x"
  assert rows[3]["fits"] is None and rows[4]["fits"] is False
  assert report.problems(rows) == [
      "chunk parallel:4 B=16 does not fit: it needs 17.00 GiB a chip, the chip has 16.00 GiB",
      "chunk tree:16 B=16 did not compile: INTERNAL: Mosaic failed to compile TPU kernel: x",
      "prefill B=16 does not fit (16.00 GiB a chip): RESOURCE_EXHAUSTED: Ran out of memory "
      "in memory space hbm. Used 20.1G of 15.75G hbm."]
  # an error of the program's own making (not the compiler's) is named
  assert report.first_line(KeyError("ngram")) == "KeyError: 'ngram'"


def test_topologies_come_from_the_chip_table():
  t = chips.parse_topology("v5e:2x4")
  assert (t.chips, t.host_bounds(), t.accelerator_type()) == (8, (2, 2, 1), "v5litepod-8")
  assert chips.parse_topology("V6E:1x1").host_bounds() == (1, 1, 1)
  assert chips.parse_topology("v4:2x2x1").accelerator_type() == "v4-8"
  for c in chips.CHIPS.values():
    assert c.source.startswith("https://cloud.google.com/tpu/docs/")
    assert c.hbm_bytes_per_s > 0 and c.peak_bf16_flops > 0
  with pytest.raises(FlexDraftError, match="GPUs are not compiled for yet"):
    chips.parse_topology("h100")
  with pytest.raises(FlexDraftError, match="unknown chip 'v9'"):
    chips.parse_topology("v9:2x2")
  with pytest.raises(FlexDraftError, match="a v4 slice is 3 numbers"):
    chips.parse_topology("v4:2x2")


def test_modes_parse_and_are_checked_against_the_drafters_block():
  target = programs.target_shape("random:tiny")
  drafter = programs.drafter_shape("random:L=2,block=4", target)
  modes = programs.parse_modes("ar, parallel:4,sequential:3,tree:8,ar")
  assert [str(m) for m in modes] == ["ar", "parallel:4", "sequential:3", "tree:8"]
  programs.check_modes(modes, drafter, target.config.vocab_size)
  with pytest.raises(FlexDraftError, match="exceeds the drafter's block size 4"):
    programs.check_modes(programs.parse_modes("parallel:8"), drafter, 264)
  with pytest.raises(FlexDraftError, match="needs a drafter"):
    programs.check_modes(programs.parse_modes("ar,tree:8"), None, 264)


def test_a_shipped_drafter_is_its_json_and_a_target_only_its_config(tmp_path):
  target = programs.target_shape("random:smollm2-135m-shape")
  shipped = programs.drafter_shape("flexdraft_jax/drafters/smollm2_135m_L8", target)
  assert (shipped.config.num_layers, shipped.config.block_size) == (8, 8)
  with pytest.raises(FlexDraftError, match="was made for target 'smollm2-135m'"):
    programs.drafter_shape("flexdraft_jax/drafters/smollm2_135m_L8",
                           programs.target_shape("random:tiny"))
  cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": True}
  (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights, no tokenizer
  for spec in (str(tmp_path), str(tmp_path / "config.json")):
    got = programs.target_shape(spec).config
    assert (got.vocab_size, got.num_layers, got.num_kv_heads) == (1000, 3, 2)


def test_building_for_a_tpu_changes_the_choices_only_inside():
  from flexdraft_jax.kernels import _platform, cpu_matmul
  from flexdraft_jax.model import attention
  before = (attention.resolve_impl("auto"), cpu_matmul.available(),
            _platform.resolve_interpret("tpu", None))
  with _platform.building_for("tpu"):
    assert attention.resolve_impl("auto") == "pallas"
    assert _platform.resolve_backend("auto") == "tpu"
    assert _platform.resolve_interpret("tpu", None) is False
    assert not cpu_matmul.available()
  assert (attention.resolve_impl("auto"), cpu_matmul.available(),
          _platform.resolve_interpret("tpu", None)) == before


def _aot(argv, capsys):
  from flexdraft_jax.aot import cli
  with pytest.raises(SystemExit) as e:
    cli.run(["flexdraft_jax aot"] + argv)
  out, err = capsys.readouterr()
  return e.value.code, out, err


def test_without_the_tpu_compiler_the_command_names_the_install(monkeypatch, capsys, tmp_path,
                                                                 absl_flags_restored):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  code, _, err = _aot(TINY + [f"--out={tmp_path}/report"], capsys)
  assert code == 1
  assert err.strip().splitlines() == [
      'error: compiling for a TPU needs the TPU compiler (libtpu): pip install "jax[tpu]"']
  assert not os.path.exists(tmp_path / "report")


def test_a_report_folder_it_did_not_write_is_refused(tmp_path, capsys, absl_flags_restored):
  (tmp_path / "notes.txt").write_text("mine")
  code, _, err = _aot(TINY + [f"--out={tmp_path}"], capsys)
  assert code == 1
  assert err.strip().splitlines() == [
      f"error: --out {tmp_path} holds files this command did not write: give a new folder"]
  assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------- with the compiler ----

@needs_tpu_compiler
def test_tiny_decode_programs_compile_with_pallas_for_v5e(tmp_path, capsys, absl_flags_restored):
  out = tmp_path / "report"
  code, md, err = _aot(TINY + ["--attn_impl=pallas", "--batch_sizes=1", "--modes=ar,sequential:4",
                               "--train_batch=2", "--train_seq_len=32", f"--out={out}"], capsys)
  assert code == 0, err
  rep = json.loads((out / report.JSON_FILE).read_text())
  assert (out / report.MD_FILE).read_text() == md
  assert rep["format"] == report.FORMAT and rep["device_kind"] == "TPU v5 lite"
  assert rep["attention"] == "pallas" and rep["devices"] == rep["devices_per_chip"] == 1
  assert rep["chip"]["hbm_bytes"] == 16 * GIB
  rows = {r["name"]: r for r in rep["programs"]}
  assert set(rows) == {"prefill B=1", "chunk ar B=1", "chunk sequential:4 B=1",
                       "train_step B=2 T=32"}
  assert rep["train"] == {"batch": 2, "seq_len": 32}
  for r in rows.values():
    assert r["compiled"] and r["error"] is None and r["fits"] is True, r
    assert 0 < r["bytes_per_chip"] < r["chip_bytes"] == 16 * GIB
    assert r["flops"] > 0 and r["bytes_accessed"] > 0 and r["predicted_step_seconds"] > 0
  assert rows["chunk ar B=1"]["vs_ar"] == 1.0
  assert rows["chunk sequential:4 B=1"]["vs_ar"] > 1.0  # 4 rows a step and a draft pass
  assert "| chunk sequential:4 B=1 | sequential:4 | 1 | yes |" in md
  # a second run replaces its own report
  code, _, err = _aot(TINY + ["--batch_sizes=1", "--modes=ar", "--notrain", f"--out={out}"],
                      capsys)
  assert code == 0, err
  assert [r["name"] for r in json.loads((out / report.JSON_FILE).read_text())["programs"]] \
      == ["prefill B=1", "chunk ar B=1"]


@needs_tpu_compiler
def test_the_pallas_attention_is_a_mosaic_kernel_in_the_tpu_program():
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flexdraft_jax.kernels import _platform
  from flexdraft_jax.kernels.attention import attend_pallas
  devices = programs.topology_devices(chips.parse_topology("v5e:1x1"))
  rep = NamedSharding(jax.sharding.Mesh(devices, ("data",)), P())
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  args = (sds((1, 4, 4, 64)), sds((1, 2, 256, 64)), sds((1, 2, 256, 64)),
          sds((1, 4), jnp.int32))
  with _platform.building_for("tpu"):
    lowered = jax.jit(attend_pallas).lower(*args)
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
  assert compiled.cost_analysis()["flops"] > 0  # the kernel's CostEstimate


def _reshaping_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...].reshape(o_ref.shape)  # (8, 128) -> (16, 64): no vector layout


@needs_tpu_compiler
def test_a_kernel_mosaic_refuses_lowers_to_text_and_fails_compiling():
  import jax
  import jax.numpy as jnp
  from jax.experimental import pallas as pl
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flexdraft_jax.kernels import _platform
  topo = chips.parse_topology("v5e:1x1")
  devices = programs.topology_devices(topo)
  rep = NamedSharding(jax.sharding.Mesh(devices, ("data",)), P())
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=rep)
  f = jax.jit(lambda x: pl.pallas_call(
      _reshaping_kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32))(x))
  with _platform.building_for("tpu"):
    text = f.lower(x).as_text()  # lowering checks nothing Mosaic checks
    assert "tpu_custom_call" in text
    row, compiled = programs.compile_row("reshaping kernel", "ar", 1, lambda: f.lower(x),
                                         topo=topo, per_chip=1, padded_batch=1)
  assert compiled is None and not row["compiled"]
  assert row["error"].startswith("INTERNAL: Mosaic failed to compile TPU kernel")
  assert "\n" not in row["error"]
  assert report.exit_status([row]) == report.EXIT_PROBLEM
