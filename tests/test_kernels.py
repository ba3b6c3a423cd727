"""Pallas attention kernels vs the XLA reference (CPU, interpret mode, fp32).

Interpret-mode compiles dominate the run time, so each test compiles one
function that returns the output and the VJP together, and packs several
cases (limits, batches) into one call. The last tests cross-lower the real
(non-interpreted) Triton and Mosaic kernels to check they lower.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexdraft_jax.kernels import attend_pallas
from flexdraft_jax.kernels import attention as kattn
from flexdraft_jax.model import attention

NAMES = ("q", "k", "v", "lim", "xk", "xv", "qg", "kg")
ALL = ("q", "k", "v", "xk", "xv")
_rng = np.random.default_rng(0)


def _normal(*shape):
  return jnp.asarray(_rng.standard_normal(shape), jnp.float32)


def _inputs(B, T, N, K, D, S, E, lim, qg=None, kg=None):
  # The cache is kv-head major, [B, K, S, D] (as attend_xla takes it).
  x = {"q": _normal(B, T, N, D), "k": _normal(B, K, S, D),
       "v": _normal(B, K, S, D), "lim": jnp.asarray(lim, jnp.int32),
       "xk": None, "xv": None, "qg": None, "kg": None}
  if E:
    x.update(xk=_normal(B, E, K, D), xv=_normal(B, E, K, D),
             qg=jnp.asarray(qg, jnp.int32), kg=jnp.asarray(kg, jnp.int32))
  return x


def _out_and_grads(fn, wrt):
  def run(inp, ct):
    def f(diff):
      a = {**inp, **diff}
      return fn(*[a[n] for n in NAMES])
    out, vjp = jax.vjp(f, {n: inp[n] for n in wrt})
    return out, vjp(ct)[0]
  return jax.jit(run)


def _close(got, want, rtol):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.all(np.isfinite(got))
  err = np.max(np.abs(got - want)) if got.size else 0.0
  assert err <= rtol * max(1.0, np.max(np.abs(want))), err


def _check(inp, wrt=ALL, kernel_inp=None, **kw):
  """Kernel (on kernel_inp, default inp) vs reference on inp: out + grads."""
  B, T, N, D = inp["q"].shape
  ct = _normal(B, T, N, D)
  want, wgrad = _out_and_grads(attention.attend_xla, wrt)(inp, ct)
  kern = functools.partial(attend_pallas, interpret=True, **kw)
  got, ggrad = _out_and_grads(kern, wrt)(kernel_inp or inp, ct)
  _close(got, want, 1e-5)
  for n in wrt:
    _close(ggrad[n], wgrad[n], 1e-4)
  return got


def _decode(B=2, N=8, K=2, D=16, S=45, bs=4, G=3, commits=(13, 5)):
  """Parallel-mode decode: verify block Lc + G mask groups (SPEC §2).

  Default GQA ratio 4 (Qwen3's)."""
  T, E = bs + G * bs, G * bs
  lim = [[c + t for t in range(bs)] + [c + g for g in range(G) for _ in range(bs)]
         for c in commits]
  qg = [-1] * bs + [g for g in range(G) for _ in range(bs)]
  return _inputs(B, T, N, K, D, S, E, lim, qg, qg[bs:])


def test_general_odd_shapes_limits_and_grads():
  """Odd T/S/E, GQA 3, limits -1/0/1/full/past-the-end, mixed groups.

  (GQA ratio 1 is covered by the prefill test, 4 by the decode test.)
  """
  K, T, S, E, ratio = 2, 7, 19, 5, 3
  lim = [[-1, 0, 1, S - 1, S + 3, 7, 12], [5, -1, 18, 0, 2, 1, 9]]
  qg = [-1, 0, 1, 1, 2, -1, 0]
  kg = [0, 2, 1, 0, 3]                      # group 3 is nobody's
  inp = _inputs(2, T, K * ratio, K, 16, S, E, lim, qg, kg)
  out = _check(inp, block_q=8, block_k=8, block_e=8)
  # Row 0 of batch 0 sees nothing (limit -1, group -1): exact zeros.
  assert not np.any(np.asarray(out[0, 0]))


def test_every_group_count():
  """1..4 groups of masks plus clean rows (-1): one compile, four layouts."""
  B, N, K, D, S, T, E = 1, 6, 2, 16, 11, 11, 9
  fn = jax.jit(functools.partial(attend_pallas, interpret=True, block_q=8,
                                 block_k=8, block_e=8))
  for ng in range(1, 5):
    qg = [-1, -1, -1] + [i % ng for i in range(T - 3)]
    kg = [i % ng for i in range(E - 1)] + [ng]      # last key: no group
    lim = [list(range(T))]
    inp = _inputs(B, T, N, K, D, S, E, lim, qg, kg)
    args = [inp[n] for n in NAMES]
    _close(fn(*args), attention.attend_xla(*args), 1e-5)


def test_decode_layout_skips_cache_past_limits():
  """Cache blocks past every row's limit are never read: poison them."""
  inp = _decode()
  bk = 8
  first_unread = ((max(13 + 3, 5 + 3) + bk) // bk) * bk   # 24
  poisoned = dict(inp)
  for n in ("k", "v"):
    poisoned[n] = inp[n].at[:, :, first_unread:].set(jnp.nan)
  _check(inp, kernel_inp=poisoned, block_q=16, block_k=bk, block_e=8)


def test_prefill_layouts():
  """Causal prompt with no extra keys, then bs masks joining at layer s."""
  p, bs, N, K, D = 9, 4, 4, 4, 16            # GQA 1
  causal = _inputs(2, p, N, K, D, p, 0, [list(range(p))] * 2)
  _check(causal, wrt=("q", "k", "v"), block_q=16, block_k=8)
  # Masks at positions p..p+bs-1 see every clean token and each other.
  lim = [list(range(p)) + [p - 1] * bs] * 2
  qg = [-1] * p + [0] * bs
  inp = _inputs(2, p + bs, N, K, D, p, bs, lim, qg, [0] * bs)
  got = jax.jit(functools.partial(attend_pallas, interpret=True, block_q=16,
                                  block_k=8))(*[inp[n] for n in NAMES])
  _close(got, attention.attend_xla(*[inp[n] for n in NAMES]), 1e-5)


def test_training_layout_frozen_cache():
  """Deep-only mask rows over the clean K/V: grads into q, xk, xv only."""
  B, N, K, D, S, bs = 2, 6, 2, 16, 37, 4
  anchors = [[4, 17, 30], [0, 22, 36]]
  lim = [[a for a in row for _ in range(bs)] for row in anchors]
  groups = [g for g in range(3) for _ in range(bs)]
  inp = _inputs(B, 3 * bs, N, K, D, S, 3 * bs, lim, groups, groups)
  _check(inp, wrt=("q", "xk", "xv"), block_q=8, block_k=8, block_e=4)


def test_tpu_kernels_in_tpu_interpret_mode():
  """The Mosaic kernels (DMA double buffering, scalar prefetch, skipped
  blocks) under TPU interpret mode, forward and all grads."""
  inp = _decode(B=1, N=6, K=2, commits=(13,))
  inp["lim"] = inp["lim"].at[0, 0].set(-1).at[0, 1].set(0)
  bk = 8
  poisoned = dict(inp)
  for n in ("k", "v"):
    poisoned[n] = inp[n].at[:, :, 24:].set(jnp.nan)
  _check(inp, kernel_inp=poisoned, backend="tpu", block_q=16, block_k=bk,
         block_e=8)


def test_cache_reaches_kernels_untouched():
  """The [B, K, S, D] cache is read in place: with S a multiple of block_k,
  k and v are consumed only by the kernels (no transpose, pad or copy), and
  their gradients are the dK/dV kernel's outputs as they come."""
  B, T, N, K, D, S, E = 1, 8, 4, 2, 16, 32, 4
  sd = jax.ShapeDtypeStruct
  args = (sd((B, T, N, D), jnp.float32), sd((B, K, S, D), jnp.float32),
          sd((B, K, S, D), jnp.float32), sd((B, T), jnp.int32),
          sd((B, E, K, D), jnp.float32), sd((B, E, K, D), jnp.float32),
          sd((T,), jnp.int32), sd((E,), jnp.int32))

  def loss(*a):
    return jnp.sum(attend_pallas(*a, interpret=True, block_q=8, block_k=8,
                                 block_e=8))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
  cache = {id(x) for x in jaxpr.invars[1:3]}
  users = [e.primitive.name for e in jaxpr.eqns
           if any(id(x) in cache for x in e.invars)]
  assert users and set(users) == {"pallas_call"}, users
  dkdv = {id(x) for x in jaxpr.outvars[1:3]}
  makers = [e for e in jaxpr.eqns if any(id(x) in dkdv for x in e.outvars)]
  assert [e.primitive.name for e in makers] == ["pallas_call"]
  assert makers[0].params["name"] == "flexdraft_attn_dcache"
  assert all(x.aval.shape == (B, K, S, D) for x in jaxpr.outvars[1:3])


def test_attend_dispatch():
  inp = _decode(B=1, commits=(7,))
  args = [inp[n] for n in NAMES]
  assert attention.resolve_impl("auto") == "xla"       # CPU
  want = attention.attend_xla(*args)
  np.testing.assert_array_equal(attention.attend(*args, impl="auto"), want)
  got = jax.jit(functools.partial(attention.attend, impl="pallas"))(*args)
  _close(got, want, 1e-5)


def test_schedule_tables_decode():
  """Decode: cache 2048, limits ~300 -> only the first blocks are visited."""
  cfg_kw = dict(backend="gpu", interpret=False, scale=1.0, bq=64, bk=64,
                be=64, n_q=2, n_k=32, n_e=2, compute_dtype="float32")
  cfg = kattn.C.Cfg(**cfg_kw)
  lim = jnp.concatenate([jnp.arange(300, 316), jnp.full((112,), 303)])[None]
  qg = jnp.concatenate([jnp.full((16,), -1), jnp.repeat(jnp.arange(8), 14)])
  kg = jnp.repeat(jnp.arange(8), 16)
  tabs = jax.jit(functools.partial(kattn._schedule, cfg))(
      lim.astype(jnp.int32), qg, kg)
  np.testing.assert_array_equal(tabs["nblk"], [[5, 5]])   # 320 of 2048 keys
  assert int(tabs["qhi_c"][0, 5]) == 0                     # block 5: no rows


def _lower(be, wrt, frozen_cache=False):
  B, T, N, K, D, S, E = 2, 16 + 4 * 16, 9, 3, 64, 2048, 4 * 16
  sd = jax.ShapeDtypeStruct
  dt = jnp.bfloat16
  args = (sd((B, T, N, D), dt), sd((B, K, S, D), dt), sd((B, K, S, D), dt),
          sd((B, E, K, D), dt), sd((B, E, K, D), dt), sd((B, T), jnp.int32),
          sd((T,), jnp.int32), sd((E,), jnp.int32))

  def loss(q, k, v, xk, xv, lim, qg, kg):
    if frozen_cache:
      k, v = jax.lax.stop_gradient(k), jax.lax.stop_gradient(v)
    o = attend_pallas(q, k, v, lim, xk, xv, qg, kg, backend=be,
                      interpret=False)
    return jnp.sum(o.astype(jnp.float32))

  fn = jax.grad(loss, argnums=wrt)
  plat = {"gpu": "cuda", "tpu": "tpu"}[be]
  txt = jax.jit(fn).trace(*args).lower(lowering_platforms=(plat,)).as_text()
  return set(re.findall(r"flexdraft_attn_(\w+?)\b", txt))


@pytest.mark.parametrize("be", ["gpu", "tpu"])
def test_real_lowering(be):
  """Triton / Mosaic lowering of forward + backward kernels (no device)."""
  assert _lower(be, (0, 1, 2, 3, 4)) == {"fwd", "dq", "dcache", "dextra"}
  # Frozen cache (training): the cache dK/dV kernel is not even traced.
  assert _lower(be, (0, 1, 2, 3, 4), frozen_cache=True) == {
      "fwd", "dq", "dextra"}


@pytest.mark.parametrize("be", ["gpu", "tpu"])
def test_real_lowering_with_a_tree(be):
  """The forward with a tree of 70 nodes (3 mask words) lowers on both."""
  B, T, N, K, D, S = 2, 70, 9, 3, 64, 2048
  sd = jax.ShapeDtypeStruct
  dt = jnp.bfloat16
  args = (sd((B, T, N, D), dt), sd((B, K, S, D), dt), sd((B, K, S, D), dt),
          sd((B, T), jnp.int32), sd((B,), jnp.int32), sd((B, T, T), jnp.bool_))
  fn = lambda q, k, v, lim, start, anc: attend_pallas(
      q, k, v, lim, tree=(start, anc), backend=be, interpret=False)
  plat = {"gpu": "cuda", "tpu": "tpu"}[be]
  txt = jax.jit(fn).trace(*args).lower(lowering_platforms=(plat,)).as_text()
  assert set(re.findall(r"flexdraft_attn_(\w+?)\b", txt)) == {"fwd"}


# ------------------------------------------------------------ draft trees ----

def _ancestors(parents):
  """anc[t, u]: u is t or one of its ancestors (parents[0] = -1, the root)."""
  T = len(parents)
  anc = np.zeros((T, T), bool)
  for t in range(T):
    u = t
    while u >= 0:
      anc[t, u] = True
      u = parents[u]
  return anc


def _tree_case(parents_per_row, starts, S, N=4, K=2, D=16):
  """B = len(starts) trees of T nodes (one per batch row), rows at their own
  slots start + t (the verify layout)."""
  B, T = len(starts), len(parents_per_row[0])
  lim = np.asarray(starts)[:, None] + np.arange(T)[None, :]
  inp = _inputs(B, T, N, K, D, S, 0, lim)
  tree = (jnp.asarray(starts, jnp.int32),
          jnp.asarray(np.stack([_ancestors(p) for p in parents_per_row])))
  return inp, lim, tree


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_tree_forward_matches_xla(backend):
  """The tree mask of the forward: a wide tree and a chain side by side
  (B = 2, GQA 2, 22 rows in blocks of 8, the tree across a key-block
  boundary), then T = 37 (two mask words) with a star and random parents;
  rows whose limit ends before the tree, sees nothing, or runs past it."""
  fn = jax.jit(functools.partial(attend_pallas, interpret=True, backend=backend,
                                 block_q=8, block_k=8))
  wide = [-1, 0, 0, 0, 1, 1, 2, 3, 3, 4, 8]
  chain = list(range(-1, 10))
  inp, lim, tree = _tree_case([wide, chain], [5, 20], S=40)
  lim[0, 3] = 2          # only slots before the tree
  lim[1, 4] = -1         # nothing
  lim[1, 10] = 40 + 3    # the whole cache: the slots past the tree too
  cases = [(inp, lim, tree)]
  star = [-1] + [0] * 36
  rand = [-1] + [int(_rng.integers(0, t)) for t in range(1, 37)]
  inp, lim, tree = _tree_case([star, rand], [0, 30], S=72)
  lim[0, 36] = 71
  cases.append((inp, lim, tree))
  for inp, lim, tree in cases:
    args = (inp["q"], inp["k"], inp["v"], jnp.asarray(lim, jnp.int32))
    want = attention.attend_xla(*args, tree=tree)
    _close(fn(*args, tree=tree), want, 1e-5)
    # The tree narrows what the rows see: without it the output differs.
    assert np.max(np.abs(attention.attend_xla(*args) - want)) > 1e-2


def test_tree_refuses_gradients_and_malformed_ancestors():
  inp, lim, tree = _tree_case([list(range(-1, 3))], [2], S=16)
  args = (inp["q"], inp["k"], inp["v"], jnp.asarray(lim, jnp.int32))
  loss = lambda q: jnp.sum(attend_pallas(q, *args[1:], tree=tree, interpret=True))
  with pytest.raises(NotImplementedError, match="no backward with a draft tree"):
    jax.grad(loss)(args[0])
  with pytest.raises(ValueError, match=r"needs ancestors \[1, 4, 4\], got \(1, 3, 3\)"):
    attend_pallas(*args, tree=(tree[0], tree[1][:, :3, :3]), interpret=True)


def test_attend_routes_trees_to_pallas(monkeypatch):
  """`attend(impl="pallas", tree=...)` runs the kernels (no XLA fallback)."""
  seen = []
  real = kattn.attend_pallas

  def spy(*a, **kw):
    seen.append(kw.get("tree") is not None)
    return real(*a, **kw)

  monkeypatch.setattr(kattn, "attend_pallas", spy)
  inp, lim, tree = _tree_case([[-1, 0, 0, 1, 1]], [3], S=16)
  args = (inp["q"], inp["k"], inp["v"], jnp.asarray(lim, jnp.int32))
  got = attention.attend(*args, impl="pallas", tree=tree)
  assert seen == [True]
  _close(got, attention.attend_xla(*args, tree=tree), 1e-5)
