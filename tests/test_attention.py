"""`attention.attend_xla` (the reference every layout and kernel is checked
against) vs a dense float64 softmax written from the module doc's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexdraft_jax.model import attention

_rng = np.random.default_rng(7)


def _dense(q, k, v, limit, xk=None, xv=None, q_group=None, k_group=None):
  """Row t of sequence b sees cache slot j iff j <= limit[b, t], extra key e
  iff q_group[t] >= 0 and q_group[t] == k_group[e]; softmax over what it sees
  (a row seeing nothing returns zeros). numpy, float64, GQA by repeating K/V."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, D = q.shape
  K, S = k.shape[1], k.shape[2]
  keys = np.repeat(k, N // K, axis=1)                       # [B, N, S, D]
  vals = np.repeat(v, N // K, axis=1)
  see = np.arange(S)[None, None, :] <= np.asarray(limit)[:, :, None]   # [B, T, S]
  if xk is not None:
    xk, xv = (np.repeat(np.asarray(x, np.float64).transpose(0, 2, 1, 3), N // K, axis=1)
              for x in (xk, xv))
    keys, vals = np.concatenate([keys, xk], 2), np.concatenate([vals, xv], 2)
    qg, kg = np.asarray(q_group), np.asarray(k_group)
    same = (qg[:, None] >= 0) & (qg[:, None] == kg[None, :])
    see = np.concatenate([see, np.broadcast_to(same, (B, T, len(kg)))], 2)
  s = np.einsum("BTND,BNSD->BNTS", q, keys) / np.sqrt(D)
  s = np.where(see[:, None], s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  w = np.where(see[:, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  den = w.sum(-1, keepdims=True)
  p = w / np.where(den > 0, den, 1.0)
  return np.einsum("BNTS,BNSD->BTND", p, vals)


def _normal(*shape):
  return jnp.asarray(_rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("extra_block", [None, 3])
def test_attend_xla_matches_a_dense_softmax(extra_block):
  """Clean rows, anchor blocks of mask rows (cache prefix + own block), and a
  row that sees nothing; output and the gradients training takes (q, extra K/V)."""
  B, N, K, D, S, bs = 2, 6, 2, 8, 13, 3
  anchors = [[2, 7, 11], [-1, 5, 9]]        # -1: the block sees no cache slot
  T = len(anchors[0]) * bs
  limit = jnp.asarray([[a for a in row for _ in range(bs)] for row in anchors], jnp.int32)
  group = jnp.asarray([g for g in range(len(anchors[0])) for _ in range(bs)], jnp.int32)
  q, k, v = _normal(B, T, N, D), _normal(B, K, S, D), _normal(B, K, S, D)
  xk, xv = _normal(B, T, K, D), _normal(B, T, K, D)
  out = attention.attend_xla(q, k, v, limit, xk, xv, group, group, extra_block=extra_block)
  want = _dense(q, k, v, limit, xk, xv, group, group)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)

  ct = _normal(B, T, N, D)
  grads = jax.grad(lambda q, xk, xv: jnp.sum(ct * attention.attend_xla(
      q, k, v, limit, xk, xv, group, group, extra_block=extra_block)), (0, 1, 2))(q, xk, xv)
  eps = 1e-3
  for arg, g in zip((q, xk, xv), grads):   # a directional finite difference in float64
    d = _normal(*arg.shape)
    f = lambda a: np.sum(np.asarray(ct, np.float64) * _dense(
        *[a if x is arg else x for x in (q, k, v)], limit,
        *[a if x is arg else x for x in (xk, xv)], group, group))
    a64 = np.asarray(arg, np.float64)
    fd = (f(a64 + eps * np.asarray(d)) - f(a64 - eps * np.asarray(d))) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * d)), fd, rtol=1e-4, atol=1e-4)


def test_attend_xla_rows_that_see_nothing_are_zero_and_clean_rows_are_causal():
  B, N, K, D, S = 1, 4, 4, 8, 6
  limit = jnp.asarray([[-1, 0, 1, 2, 3, 4]], jnp.int32)   # row 0 sees no key
  q, k, v = _normal(B, S, N, D), _normal(B, K, S, D), _normal(B, K, S, D)
  out = np.asarray(attention.attend_xla(q, k, v, limit))
  assert not np.any(out[0, 0])
  np.testing.assert_allclose(out, _dense(q, k, v, limit), rtol=1e-5, atol=1e-6)
  # Causal: changing a key past a row's limit leaves that row unchanged.
  k2 = k.at[:, :, 5].set(100.0)
  np.testing.assert_array_equal(np.asarray(attention.attend_xla(q, k2, v, limit))[:, :5],
                                out[:, :5])
