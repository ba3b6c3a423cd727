"""flexdraft_jax: lossless self-speculative decoding (FlexDraft) in JAX."""

from flexdraft_jax.api import (GenerateResult, GenerateStream, Mode, RuntimeOptions,
                               SamplingParams, SpecOptions, StreamChunk, generate,
                               generate_stream, load_drafter, load_target, target_logits,
                               use_compile_cache)
from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning

__all__ = ["FlexDraftError", "FlexDraftWarning", "GenerateResult", "GenerateStream", "Mode",
           "RuntimeOptions", "SamplingParams", "SpecOptions", "StreamChunk", "generate",
           "generate_stream", "load_drafter", "load_target", "target_logits",
           "use_compile_cache"]
__version__ = "0.1.0"
