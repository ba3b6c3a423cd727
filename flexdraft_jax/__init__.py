"""flexdraft_jax: lossless self-speculative decoding (FlexDraft) in JAX."""

from flexdraft_jax.api import (GenerateResult, Mode, RuntimeOptions, SamplingParams,
                               SpecOptions, generate, load_drafter, load_target,
                               target_logits)
from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning

__all__ = ["FlexDraftError", "FlexDraftWarning", "GenerateResult", "Mode", "RuntimeOptions",
           "SamplingParams", "SpecOptions", "generate", "load_drafter", "load_target",
           "target_logits"]
__version__ = "0.1.0"
