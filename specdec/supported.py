"""Which models specdec decodes exactly, from their config alone: decoder-only causal LMs whose per-token state is a
KV cache that can be cut back to any position, with attention that runs through transformers' attention interface."""

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .errors import UnsupportedModel

# Families whose per-token state is not a KV cache that can be cut back to any position (recurrent,
# state-space, linear-attention or hybrid layers): a rejected draft token cannot be rolled back exactly.
RECURRENT = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma", "qwen3_next", "qwen3_5", "qwen3_5_moe",
    "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "xlstm", "minimax",
    "nemotron_h", "plamo2", "kimi_linear", "olmo_hybrid",
})
# Causal LMs whose attention does not run through transformers' attention interface (ALiBi, or a path of
# their own) and does not take a CachedLM's mask and positions as they are, so a tree or rows of different
# lengths would be wrong or crash (Falcon with ALiBi: "size of tensor a (29) must match ... b (22)"). ALiBi
# derives each key's position from a 2D mask's running count, which cannot say a tree node's depth; GPT-Neo's
# local layers window by cache slot, not by position. (Own paths that do take them: kvcache.OWN_PATH_ATTENTION.)
OWN_ATTENTION = frozenset({
    "bloom", "mpt", "gpt_neo", "gpt_neox_japanese", "xglm", "cpmant", "reformer",
    "xlnet", "xlm", "big_bird", "rembert", "roformer", "prophetnet", "mvp", "trocr", "fuyu", "got_ocr2",
})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})  # config.layer_types specdec runs


def check_supported(config: PretrainedConfig) -> None:
    """Raise UnsupportedModel, naming the model type and why, for a model specdec cannot decode exactly;
    from its config alone, before any weights load."""
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(model_type, "it is an encoder-decoder; specdec serves decoder-only causal LMs")
    if model_type in RECURRENT:
        raise UnsupportedModel(model_type, "it has recurrent or state-space layers, whose state cannot be rolled "
                                           "back per token as a KV cache can when draft tokens are rejected")
    others = sorted({t for t in getattr(config, "layer_types", None) or () if t not in ATTENTION_LAYERS})
    if others:
        raise UnsupportedModel(model_type, f"it has {', '.join(others)} layers, whose state cannot be rolled back "
                                           "per token as a KV cache can when draft tokens are rejected")
    if model_type == "falcon" and getattr(config, "alibi", False):
        raise UnsupportedModel(model_type, "it uses ALiBi (alibi: true), which Falcon builds from a 2D mask's "
                                           "running count of tokens; a tree's node positions cannot be said so")
    if model_type in OWN_ATTENTION:
        raise UnsupportedModel(model_type, "its attention (ALiBi or a path of its own) does not run through "
                                           "transformers' attention interface, which specdec's tree and batched "
                                           "attention needs")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(model_type, "it is not a causal language model (no AutoModelForCausalLM class)")
