"""Loading a llama.cpp GGUF file (llama / qwen2 / qwen3), dequantized to float.

llama.cpp's converter permutes the q/k rows of "llama" models so that its RoPE
can rotate adjacent pairs; transformer.py's RoPE is HF's rotate-half, so those
rows are permuted back. qwen2/qwen3 files use NeoX RoPE and are not permuted.

Reading a GGUF header parses every metadata field element by element — for
SmolLM2 its 49,152-token vocabulary and 48,900 merges, seconds of a command's
start. The first load keeps an index of the file (its metadata, and each
tensor's type, offset and shape) in `$FLEXDRAFT_GGUF_INDEX` (a folder; `off`:
none), else `$XDG_CACHE_HOME/flexdraft_jax/gguf_index` (`paths.cache_root`);
later loads read the index and map the tensors where it says. The index is
found by the file's real path, size and modification time, gguf's version and
INDEX_VERSION, and holds a SHA-256 of the file's header (every byte before the
tensor data: the metadata and the tensors' types, offsets and shapes, all the
index keeps), checked on each load: a file edited in place keeping its size and
modification time (a tool that restores them, an edit within a file system's
time granularity) is read afresh, not served its old config. The hash reads
1.8 MB for SmolLM2, a few ms; the tensors' data is mapped from the file itself,
never from the index. (The file's inode and change time would catch such edits
too, but change with a mere chmod or a copy back, and are not kept by every
file system; the header's bytes are the very content the index stands for.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import NamedTuple, Optional

import numpy as np

from flexdraft_jax import paths
from flexdraft_jax.model import weights
from flexdraft_jax.model.config import FlexDraftError, ModelConfig, rope_scaling_tuple
from flexdraft_jax.model.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                 "lm_head": "output.weight"}
_LAYER_NAMES = {
    "input_norm": "attn_norm.weight", "post_norm": "ffn_norm.weight",
    "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
    "o": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight"}
_MATRICES = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


INDEX_ENV = "FLEXDRAFT_GGUF_INDEX"
INDEX_OFF = ("off", "0", "none", "false")
INDEX_VERSION = 2  # bump when the index's content or meaning changes

log = logging.getLogger(__name__)


class _Tensor(NamedTuple):
  """What loading reads of a GGUF tensor: its quantization type and its raw
  data (as `gguf.GGUFReader` shapes it: elements, or bytes of quantized rows)."""
  tensor_type: object
  data: np.ndarray


def _open(path: str):
  import gguf  # imported lazily: only GGUF targets need it
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # truncation surfaces as ValueError/IndexError/...
    raise FlexDraftError(f"corrupt or truncated GGUF file {path}: {e}") from e


def _metadata(reader) -> dict:
  """Every metadata field as a python value."""
  return {name: field.contents() for name, field in reader.fields.items()}


def index_path(path: str) -> Optional[str]:
  """Where the index of GGUF file `path` is kept (None: indexing is off)."""
  import gguf
  setting = os.environ.get(INDEX_ENV)
  if setting is not None and setting.strip().lower() in INDEX_OFF + ("",):
    return None
  root = setting or os.path.join(paths.cache_root(), "flexdraft_jax", "gguf_index")
  st = os.stat(path)
  version = getattr(gguf, "__version__", None) or _gguf_version()
  key = hashlib.sha256(f"{INDEX_VERSION}|{version}|{os.path.realpath(path)}|"
                       f"{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
  return os.path.join(root, f"{key}.json")


def _gguf_version() -> str:
  from importlib import metadata
  try:
    return metadata.version("gguf")
  except metadata.PackageNotFoundError:
    return "unknown"


def read_gguf(path: str) -> tuple:
  """(metadata dict, {tensor name: _Tensor}) of GGUF file `path`: from its
  index where one is kept (module doc), else parsed, and the index written."""
  import gguf
  where = index_path(path)
  if where and os.path.isfile(where):
    try:
      with open(where) as f:
        index = json.load(f)
      if _header_digest(path, index["header_bytes"]) != index["header_sha256"]:
        raise ValueError("the file's header changed since it was indexed")
      data = np.memmap(path, dtype=np.uint8, mode="r")
      tensors = {}
      for t in index["tensors"]:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["shape"], dtype=np.int64))
        raw = data[t["offset"]:t["offset"] + count * dtype.itemsize].view(dtype)
        tensors[t["name"]] = _Tensor(gguf.GGMLQuantizationType(t["type"]),
                                     raw.reshape(t["shape"]))
      return index["meta"], tensors
    except (OSError, ValueError, KeyError, TypeError) as e:  # read afresh below
      log.info("flexdraft_jax: GGUF index %s not used (%s); reading %s", where, e, path)
  reader = _open(path)
  meta = _metadata(reader)
  tensors = {t.name: _Tensor(t.tensor_type, t.data) for t in reader.tensors}
  if where:
    _write_index(where, meta, reader)
  return meta, tensors


def _header_digest(path: str, size: int) -> Optional[str]:
  """SHA-256 of the first `size` bytes of file `path` (None: it is shorter)."""
  with open(path, "rb") as f:
    head = f.read(size)
  return hashlib.sha256(head).hexdigest() if len(head) == size else None


def _write_index(where: str, meta: dict, reader) -> None:
  """Writes the index atomically; a folder that cannot be written (or
  metadata JSON cannot hold) only costs the next load its speed. The header's
  hash is of the bytes the reader parsed (its map of the file)."""
  header = int(reader.data_offset)
  index = {"version": INDEX_VERSION, "meta": meta, "header_bytes": header,
           "header_sha256": hashlib.sha256(reader.data[:header]).hexdigest(), "tensors": [
      {"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset),
       "dtype": t.data.dtype.str, "shape": [int(d) for d in t.data.shape]}
      for t in reader.tensors]}
  tmp = None
  try:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=os.path.dirname(where))
    with os.fdopen(fd, "w") as f:
      json.dump(index, f)
    os.replace(tmp, where)
    tmp = None
  except (OSError, TypeError, ValueError) as e:
    log.info("flexdraft_jax: GGUF index not written to %s (%s)", where, e)
  finally:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)


def _rope_scaling(meta: dict, arch: str, tensor_names: set, path: str):
  if "rope_freqs.weight" in tensor_names:
    raise FlexDraftError(
        f"unsupported rope scaling in {path}: per-frequency factors (rope_freqs, llama3 "
        "scaling) in GGUF; load the HF safetensors checkpoint instead")
  kind = meta.get(f"{arch}.rope.scaling.type", "none")
  if kind == "none":
    return None
  scaling = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
  return rope_scaling_tuple(scaling)


def read_config(meta: dict, tensor_names: set, path: str) -> ModelConfig:
  """ModelConfig from GGUF metadata (`{arch}.*` keys and the tokenizer's special ids)."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise FlexDraftError(f"unsupported architecture {arch!r} in {path} "
                         f"(supported GGUF architectures: {', '.join(ARCHITECTURES)})")
  g = lambda key, default=None: meta.get(f"{arch}.{key}", default)
  H, heads = int(g("embedding_length")), int(g("attention.head_count"))
  vocab = g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
  eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=H, intermediate_size=int(g("feed_forward_length")),
      num_layers=int(g("block_count")), num_heads=heads,
      num_kv_heads=int(g("attention.head_count_kv", heads)),
      head_dim=int(g("attention.key_length", H // heads)),
      rope_theta=float(g("rope.freq_base", 10000.0)),
      rope_scaling=_rope_scaling(meta, arch, tensor_names, path),
      rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
      qk_norm=arch == "qwen3", attention_bias=arch == "qwen2",
      tie_embeddings=_GLOBAL_NAMES["lm_head"] not in tensor_names,
      max_position_embeddings=int(g("context_length", 8192)),
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
      pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id") or 0), model_type=arch)


def unpermute_rows(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation (interleaved pairs -> two halves per head).

  Works on weights `[out, in]` and biases `[out]`.
  """
  out = w_OxI.shape[0]
  rest = w_OxI.shape[1:]
  half = out // n_heads // 2
  w = w_OxI.reshape(n_heads, half, 2, *rest)
  return np.swapaxes(w, 1, 2).reshape(w_OxI.shape)


class _GGUFTensors:
  """Name -> dequantized float32 host array `[out, in]` (numpy row-major order)."""

  def __init__(self, tensors: dict, path: str):
    self.path = path
    self.tensors = tensors

  def get(self, name: str) -> np.ndarray:
    import gguf
    if name not in self.tensors:
      raise FlexDraftError(f"missing tensor {name} in {self.path}")
    t = self.tensors[name]
    try:
      x = gguf.dequantize(t.data, t.tensor_type)
    except Exception as e:
      raise FlexDraftError(f"cannot dequantize {name} ({t.tensor_type.name}) in "
                           f"{self.path}: {e}") from e
    return np.asarray(x, dtype=np.float32)


def load_gguf(path: str, dtype, layout: str = "stacked") -> tuple:
  """(ModelConfig, params, Tokenizer) of a GGUF file."""
  meta, tensors = read_gguf(path)
  store = _GGUFTensors(tensors, path)
  try:
    cfg = read_config(meta, set(store.tensors), path)
  except FlexDraftError:
    raise
  except (TypeError, ValueError) as e:  # a required `{arch}.*` key is absent
    raise FlexDraftError(f"incomplete GGUF metadata in {path}: {e}") from e
  permuted = cfg.model_type == "llama"
  heads = {"q": cfg.num_heads, "q_bias": cfg.num_heads,
           "k": cfg.num_kv_heads, "k_bias": cfg.num_kv_heads}

  def fetch(key: str, name: str) -> np.ndarray:
    x = store.get(name)
    if permuted and key in heads:
      x = unpermute_rows(x, heads[key])
    return x.T if key in _MATRICES else x

  params = weights.build_params(
      cfg, lambda k: fetch(k, _GLOBAL_NAMES[k]),
      lambda k, i: fetch(k, f"blk.{i}.{_LAYER_NAMES[k]}"), dtype, layout)
  tokenizer = Tokenizer.from_gguf_fields(meta)
  return cfg, params, tokenizer
