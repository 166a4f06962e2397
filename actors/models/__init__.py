"""Model implementations written for paged KV and tensor parallelism (Llama family).

Must not import: ray, serve_app.
"""

from actors.models.attention import AttentionMetadata, PrefillSpan
from actors.models.config import ModelConfig, from_hf_config
from actors.models.llama import LlamaForCausalLM, WeightShard
from actors.models.parallel import TPContext

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "ModelConfig", "PrefillSpan", "TPContext", "WeightShard",
           "from_hf_config"]
