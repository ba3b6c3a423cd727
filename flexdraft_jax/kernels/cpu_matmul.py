"""A small-row fp32 matmul for decoding on a CPU (`cpu/matmul_t.cc`, an XLA FFI
custom call).

`matmul_t(w_OxI, x_NxI)` is `x @ w.T`. XLA:CPU runs the 2-16 rows of a verify
or mask block through a GEMM that takes about twice one row's time although
both stream the same weights; the kernel reads each weight row once per 8
input rows, and sums every output element in one fixed order whatever the
number of rows, so an AR step and a verify block compute identical rows.
With bf16 weights (`w_OxI.dtype == bfloat16`: the draft pass, see
`decode_params.resolve_draft_dtype`) it rounds x to bf16 and sums exact bf16 products in fp32
— AVX512-BF16's dot instruction where the CPU has it — on half the bytes.

The C++ source is compiled once per machine with the system's C++ compiler
(`c++`, or `$CXX`) against jaxlib's FFI headers, into
`$FLEXDRAFT_KERNEL_CACHE` (default `$XDG_CACHE_HOME/flexdraft_jax/kernels`,
`paths.cache_root`: `~/.cache` without it), keyed by the source, jaxlib's version and the CPU's
flags; `launch/setup.sh` builds it at install (`python -m flexdraft_jax
build-kernel`). Where it cannot be built (no compiler) decoding keeps XLA's dot
and says so once. `FLEXDRAFT_CPU_MATMUL=0` turns it off.

It is built for the host's own ISA (`-march=native`: AVX-512, AVX2 or, on
other CPUs, their vectors); `FLEXDRAFT_CPU_ISA=avx2` or `generic` (x86-64
without AVX) builds and runs an older ISA's variant instead, to measure or
test it on a newer host. Every variant sums in the same 16-lane order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from flexdraft_jax import paths
from flexdraft_jax.kernels import _platform

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu", "matmul_t.cc")
_TARGET = "flexdraft_matmul_t"
_TARGET_BF16 = "flexdraft_matmul_t_bf16"
_LOADED = []  # the registered library (kept loaded)

log = logging.getLogger(__name__)


def enabled_by_env() -> bool:
  return os.environ.get("FLEXDRAFT_CPU_MATMUL", "1") != "0"


def cache_dir() -> str:
  env = os.environ.get("FLEXDRAFT_KERNEL_CACHE")
  if env:
    return env
  return os.path.join(paths.cache_root(), "flexdraft_jax", "kernels")


def _cpu_flags() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line
  except OSError:
    pass
  return platform.processor()


# The ISA variants: what -march each builds for, and the CPU flags it needs.
ISAS = {
    "native": ((), ()),
    "avx2": (("-march=x86-64-v3", "-mtune=native"), ("avx2", "fma")),
    "generic": (("-march=x86-64-v2", "-mtune=native"), ()),
}
ISA_ENV = "FLEXDRAFT_CPU_ISA"


def runnable_isas() -> list:
  """The variants this host can build and run: "native" everywhere, the
  x86 ones on x86-64 hosts whose CPU has their flags."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return ["native"]
  flags = set(_cpu_flags().split())
  return [name for name, (_, need) in ISAS.items() if set(need) <= flags]


def selected_isa() -> str:
  """`$FLEXDRAFT_CPU_ISA` where this host runs it, else "native" (with a
  warning naming what was asked)."""
  isa = os.environ.get(ISA_ENV, "native").strip() or "native"
  if isa not in ISAS:
    log.warning("flexdraft_jax: %s=%s is not one of %s; building the native kernel",
                ISA_ENV, isa, ", ".join(ISAS))
    return "native"
  if isa not in runnable_isas():
    log.warning("flexdraft_jax: %s=%s does not run on this CPU (it runs %s); building "
                "the native kernel", ISA_ENV, isa, ", ".join(runnable_isas()))
    return "native"
  return isa


def _key(defines=(), isa: str = "native") -> str:
  import jaxlib
  h = hashlib.sha256()
  h.update(" ".join(defines).encode())
  if isa != "native":  # the native key as before: kernels already built stay valid
    h.update(f"isa={isa}".encode())
  with open(_SOURCE, "rb") as f:
    h.update(f.read())
  h.update(jaxlib.__version__.encode())
  h.update(platform.machine().encode())
  h.update(_cpu_flags().encode())
  return h.hexdigest()[:16]


def compile_command(out: str, defines=(), isa: str = "native") -> list:
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
  march = ISAS[isa][0] or ("-march=native",)
  return [cxx, "-O3", *march, "-ffp-contract=fast", "-std=c++17",
          "-shared", "-fPIC", *(f"-D{d}" for d in defines), "-I", jax.ffi.include_dir(),
          _SOURCE, "-o", out]


def build(verbose: bool = False, defines=(), isa: str = "native") -> str:
  """The compiled library's path, compiling it first if needed (raises
  RuntimeError with the compiler's message when that fails). `defines`:
  preprocessor macros (tests build the portable bf16 path with
  FLEXDRAFT_GENERIC_BF16); `isa`: a key of ISAS."""
  path = os.path.join(cache_dir(), f"matmul_t-{_key(defines, isa)}.so")
  if os.path.exists(path):
    return path
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  except OSError as e:  # an unwritable cache: build for this process only
    log.warning("flexdraft_jax: cannot write the kernel cache %s (%s); building in "
                "a temporary directory", os.path.dirname(path), e)
    path = os.path.join(tempfile.mkdtemp(prefix="flexdraft_kernels_"), os.path.basename(path))
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = compile_command(tmp, defines, isa)
  if verbose:
    print("flexdraft_jax: compiling the CPU matmul kernel:", " ".join(cmd))
  try:
    r = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    os.unlink(tmp)
    raise RuntimeError(f"cannot run the C++ compiler {cmd[0]}: {e}") from e
  if r.returncode:
    os.unlink(tmp)
    raise RuntimeError(f"{cmd[0]} failed on {_SOURCE}: {r.stderr.strip()[-2000:]}")
  os.replace(tmp, path)  # atomic: a concurrent build leaves one complete file
  return path


@functools.lru_cache(maxsize=None)
def _register() -> bool:
  try:
    lib = ctypes.CDLL(build(isa=selected_isa()))
  except (OSError, RuntimeError) as e:
    log.warning("flexdraft_jax: the CPU matmul kernel is unavailable (%s); "
                "decoding uses XLA's dot", str(e).splitlines()[0])
    return False
  if not _LOADED:  # XLA keeps one handler a name for the process
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.FlexdraftMatmulT),
                                platform="cpu")
    jax.ffi.register_ffi_target(_TARGET_BF16, jax.ffi.pycapsule(lib.FlexdraftMatmulTBf16),
                                platform="cpu")
    _LOADED.append(lib)
  return True


def available() -> bool:
  """Whether `matmul_t` runs the kernel here (programs are built for a CPU,
  `_platform.platform()`, the switch is on, and the library builds and loads)."""
  return enabled_by_env() and _platform.platform() == "cpu" and _register()


def build_info() -> str:
  """The loaded kernel's ISA and register blocking, e.g. "avx2 2x3" (weight x
  input rows a block), or "" where the kernel does not run here."""
  if not available():
    return ""
  return library_build_info(_LOADED[0])


def library_build_info(lib) -> str:
  """The ISA and block of a loaded kernel library (a ctypes.CDLL)."""
  lib.FlexdraftMatmulTBuild.restype = ctypes.c_char_p
  return lib.FlexdraftMatmulTBuild().decode()


def supports(w_OxI, x_NxI) -> bool:
  """fp32 x against fp32 or bf16 weights, both 2-D, where the kernel runs."""
  return (w_OxI.dtype in (jnp.float32, jnp.bfloat16) and x_NxI.dtype == jnp.float32
          and w_OxI.ndim == 2 and x_NxI.ndim == 2 and available())


def _call(w_OxI, x_NxI):
  if not _register():
    raise RuntimeError("the CPU matmul kernel is unavailable (see the warning above)")
  out = jax.ShapeDtypeStruct((x_NxI.shape[0], w_OxI.shape[0]), jnp.float32)
  name = _TARGET_BF16 if w_OxI.dtype == jnp.bfloat16 else _TARGET
  return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x_NxI, w_OxI)


@jax.custom_vjp
def matmul_t(w_OxI, x_NxI):
  """`x @ w.T` `[N, O]` in fp32, w fp32 or bf16 (check `supports` first)."""
  return _call(w_OxI, x_NxI)


def _fwd(w_OxI, x_NxI):
  return _call(w_OxI, x_NxI), (w_OxI, x_NxI)


def _bwd(res, g_NxO):
  w_OxI, x_NxI = res
  return (g_NxO.T @ x_NxI).astype(w_OxI.dtype), g_NxO @ w_OxI.astype(jnp.float32)


matmul_t.defvjp(_fwd, _bwd)


def run(argv):
  """Entry from `python -m flexdraft_jax build-kernel` (launch/setup.sh): compiles
  the kernel into its cache now rather than on the first decode."""
  usage = ("usage: python -m flexdraft_jax build-kernel (no arguments): compiles the "
           "CPU decode matmul kernel into its cache")
  if argv[1:] in (["--help"], ["-h"], ["-?"]):
    print(usage)
    return
  if len(argv) > 1:
    raise SystemExit(usage)
  try:
    print("flexdraft_jax: CPU matmul kernel at", build(verbose=True, isa=selected_isa()))
  except RuntimeError as e:
    raise SystemExit(f"flexdraft_jax: cannot build the CPU matmul kernel: {e}")
