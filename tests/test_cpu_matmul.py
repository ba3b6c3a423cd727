"""The CPU decode matmul kernel (flexdraft_jax/kernels/cpu_matmul.py)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexdraft_jax.kernels import cpu_matmul
from flexdraft_jax.model import transformer

needs_kernel = pytest.mark.skipif(
    not cpu_matmul.available(),
    reason="the CPU matmul kernel does not build here (no C++ compiler, or not a CPU)")


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@needs_kernel
@pytest.mark.parametrize("O,I", [(64, 48), (33, 35), (1, 16), (130, 7)])
@pytest.mark.parametrize("N", [1, 3, 8, 9, 17])
def test_kernel_matches_a_float64_product(O, I, N):
  """Odd output counts (a lone last weight row), inputs with a tail past the
  16-lane vectors and more rows than one pass takes (8)."""
  w, x = _rand((O, I), 0), _rand((N, I), 1)
  y = np.asarray(jax.jit(cpu_matmul.matmul_t)(w, x))
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  assert y.shape == (N, O)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(I))


@needs_kernel
def test_kernel_rows_do_not_depend_on_how_many_rows_come_with_them():
  """Row n of an N-row product is bit-identical to the same row alone: an AR
  step and a verify block compute the same numbers."""
  w, x = _rand((96, 200), 2), _rand((17, 200), 3)
  f = jax.jit(cpu_matmul.matmul_t)
  full = np.asarray(f(w, x))
  for n in (0, 7, 8, 16):
    np.testing.assert_array_equal(full[n], np.asarray(f(w, x[n:n + 1]))[0])
  np.testing.assert_array_equal(full[3:11], np.asarray(f(w, x[3:11])))


@needs_kernel
def test_transformer_matmul_t_runs_the_kernel_and_the_switch_turns_it_off(monkeypatch):
  w, x = _rand((40, 24), 4), _rand((2, 3, 24), 5)
  hlo = jax.jit(transformer.matmul_t).lower(w, x).as_text()
  assert cpu_matmul._TARGET in hlo
  monkeypatch.setenv("FLEXDRAFT_CPU_MATMUL", "0")
  # a new function: jit's trace cache would replay the first trace
  hlo_off = jax.jit(lambda w, x: transformer.matmul_t(w, x)).lower(w, x).as_text()
  assert cpu_matmul._TARGET not in hlo_off
  np.testing.assert_allclose(jax.jit(transformer.matmul_t)(w, x),
                             jnp.einsum("BTI,OI->BTO", x, w), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_has_the_product_gradient():
  w, x = _rand((12, 20), 6), _rand((5, 20), 7)
  loss = lambda f: (lambda w, x: jnp.sum(jnp.sin(f(w, x))))
  g = jax.grad(loss(cpu_matmul.matmul_t), argnums=(0, 1))(w, x)
  g_ref = jax.grad(loss(lambda w, x: x @ w.T), argnums=(0, 1))(w, x)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _bf16_reference(w_bf16, x):
  """x rounded to bf16 times the bf16 weights, in float64."""
  xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  return xr @ np.asarray(w_bf16.astype(jnp.float32), np.float64).T


@needs_kernel
@pytest.mark.parametrize("O,I", [(64, 64), (33, 35), (1, 16), (130, 7), (40, 100)])
@pytest.mark.parametrize("N", [1, 3, 8, 9])
def test_bf16_kernel_is_the_product_of_bf16_rounded_inputs(O, I, N):
  """bf16 weights: x rounded to bf16, exact pair products summed in fp32 (a
  tail past the 32-value vectors, a lone last weight row, more than 8 rows)."""
  w, x = _rand((O, I), 10).astype(jnp.bfloat16), _rand((N, I), 11)
  y = np.asarray(jax.jit(cpu_matmul.matmul_t)(w, x))
  assert y.dtype == np.float32 and y.shape == (N, O)
  np.testing.assert_allclose(y, _bf16_reference(w, x), rtol=1e-5, atol=1e-5 * np.sqrt(I))
  # not the fp32 product: x was rounded
  assert not np.allclose(y, np.asarray(x, np.float64) @ np.asarray(
      w.astype(jnp.float32), np.float64).T, rtol=1e-6, atol=1e-6)
  full = np.asarray(jax.jit(cpu_matmul.matmul_t)(w, x))
  np.testing.assert_array_equal(full[-1], np.asarray(cpu_matmul.matmul_t(w, x[-1:]))[0])


@needs_kernel
def test_bf16_kernel_without_the_dot_instruction_computes_the_same_product(tmp_path,
                                                                           monkeypatch):
  """The portable path (pairs widened to fp32; what a CPU without AVX512-BF16
  runs), built apart with FLEXDRAFT_GENERIC_BF16 and called directly."""
  import ctypes
  monkeypatch.setenv("FLEXDRAFT_KERNEL_CACHE", str(tmp_path))
  path = cpu_matmul.build(defines=("FLEXDRAFT_GENERIC_BF16",))
  assert path != cpu_matmul.build()
  lib = ctypes.CDLL(path)
  jax.ffi.register_ffi_target("flexdraft_test_generic_bf16",
                              jax.ffi.pycapsule(lib.FlexdraftMatmulTBf16), platform="cpu")
  w, x = _rand((70, 100), 12).astype(jnp.bfloat16), _rand((9, 100), 13)
  out = jax.ShapeDtypeStruct((9, 70), jnp.float32)
  y = jax.ffi.ffi_call("flexdraft_test_generic_bf16", out, vmap_method="sequential")(x, w)
  np.testing.assert_allclose(y, _bf16_reference(w, x), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(y, cpu_matmul.matmul_t(w, x), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_transformer_matmul_t_takes_the_bf16_kernel_for_bf16_weights():
  w, x = _rand((40, 24), 14).astype(jnp.bfloat16), _rand((2, 3, 24), 15)
  hlo = jax.jit(transformer.matmul_t).lower(w, x).as_text()
  assert cpu_matmul._TARGET_BF16 in hlo
  y = jax.jit(transformer.matmul_t)(w, x)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y).reshape(6, 40),
                             _bf16_reference(w, np.asarray(x).reshape(6, 24)),
                             rtol=1e-5, atol=1e-5)


def test_no_compiler_warns_once_and_decoding_keeps_xla_dot(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("FLEXDRAFT_KERNEL_CACHE", str(tmp_path / "kernels"))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  cpu_matmul._register.cache_clear()
  try:
    with caplog.at_level(logging.WARNING):
      assert not cpu_matmul.available()
      assert not cpu_matmul.available()
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
    w, x = _rand((8, 16), 8), _rand((1, 2, 16), 9)
    hlo = jax.jit(lambda w, x: transformer.matmul_t(w, x)).lower(w, x).as_text()
    assert cpu_matmul._TARGET not in hlo
    assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left
  finally:
    cpu_matmul._register.cache_clear()


def test_an_unwritable_cache_builds_in_a_temporary_directory(monkeypatch, tmp_path):
  if cpu_matmul.shutil.which("c++") is None and cpu_matmul.shutil.which("g++") is None:
    pytest.skip("no C++ compiler on this machine")
  blocked = tmp_path / "file"
  blocked.write_text("not a directory")
  monkeypatch.setenv("FLEXDRAFT_KERNEL_CACHE", str(blocked / "kernels"))
  path = cpu_matmul.build()
  assert not path.startswith(str(blocked)) and path.endswith(".so")


@needs_kernel
def test_build_info_names_the_isa_and_block_the_kernel_was_built_for():
  """The key step costs measured with this build are kept under."""
  import re
  info = cpu_matmul.build_info()
  m = re.fullmatch(r"(avx512|avx2|generic) ([1-4])x([1-8])", info)
  assert m, info
  flags = cpu_matmul._cpu_flags().split()
  expected = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= set(flags) else "generic"
  assert m.group(1) == expected


def _variant(isa, tmp_path_factory):
  """The kernel built for `isa`, registered under a name of its own."""
  import ctypes
  path = cpu_matmul.build(isa=isa)
  lib = ctypes.CDLL(path)
  name = f"flexdraft_test_matmul_{isa}"
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.FlexdraftMatmulT), platform="cpu")

  def f(w, x):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x, w)
  return lib, jax.jit(f)


@needs_kernel
@pytest.mark.parametrize("isa", sorted(cpu_matmul.ISAS))
def test_each_isa_build_sums_rows_alike_whatever_rows_come_with_them(isa, tmp_path_factory):
  """Every variant this host runs (an AVX2 build on an AVX-512 host too):
  its ISA and block as built, a float64-close product, and row n of an
  N-row product bit-identical to the row alone and to any slice with it."""
  if isa not in cpu_matmul.runnable_isas():
    pytest.skip(f"this CPU does not run the {isa} build")
  lib, f = _variant(isa, tmp_path_factory)
  info = cpu_matmul.library_build_info(lib)
  if isa != "native":
    assert info.startswith(isa + " "), info
  w, x = _rand((150, 200), 20), _rand((21, 200), 21)
  full = np.asarray(f(w, x))
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5 * np.sqrt(200))
  for n in (0, 3, 5, 8, 20):
    np.testing.assert_array_equal(full[n], np.asarray(f(w, x[n:n + 1]))[0])
  for lo, hi in ((0, 6), (2, 9), (4, 17), (1, 21)):
    np.testing.assert_array_equal(full[lo:hi], np.asarray(f(w, x[lo:hi])))


def test_isa_setting_names_what_it_builds(monkeypatch, caplog):
  monkeypatch.setenv(cpu_matmul.ISA_ENV, "generic")
  if platform_is_x86():
    assert cpu_matmul.selected_isa() == "generic"
  monkeypatch.setenv(cpu_matmul.ISA_ENV, "avx9000")
  with caplog.at_level(logging.WARNING):
    assert cpu_matmul.selected_isa() == "native"
  assert "FLEXDRAFT_CPU_ISA=avx9000 is not one of native, avx2, generic" in caplog.text


def platform_is_x86() -> bool:
  import platform
  return platform.machine().lower() in ("x86_64", "amd64")
