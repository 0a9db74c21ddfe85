"""An EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv 2503.01840): one decoder layer that drafts from the target's own hidden
states, fused from a low, a middle and a high layer, over a reduced draft vocabulary.

At position t the head reads the pair (f_t, x_{t+1}): f_t the target's hidden states at position t
(the inputs of its layers `aux_layers`, concatenated [3 Ht] and fused by `fc` to [H]) and the embedding
of the token after it, and predicts x_{t+2}. Drafting deeper than one token, it reads its own pre-norm
output in place of f (already [H]: no fc). Its logits cover `draft_vocab_size` ids; draft id i is target
id i + d2t[i].

The layout is the one vLLM and SGLang load (a published head works unchanged): config.json with
`draft_vocab_size`, `target_hidden_size` (default hidden_size), `eagle_config.eagle_aux_hidden_state_layer_ids`
(default 2, L // 2, L - 3 of the target's L layers), `norm_before_residual`, `bias` (fc's); weights
`midlayer.*` (q/k/v take [2 H]: the token's embedding and the feature), `fc`, `norm`, `lm_head`, `d2t`,
`t2d` (ignored) and `embed_tokens` (optional: else the target's)."""

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaPreTrainedModel, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from .cpu_linear import weight_dtype
from .device import HOST
from .eagle3_config import ARCHITECTURES, default_aux_layers, read_config, weights_file
from .errors import HeadMismatch


def spread_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """The layers a head trained here reads: EAGLE-3's default where its three are distinct, else three
    spread over a shallow target."""
    low, mid, high = default_aux_layers(target_layers)
    if 0 <= low < mid < high:
        return low, mid, high
    return 0, target_layers // 2, target_layers - 1  # a target of fewer than 3 layers: some read twice


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [embedding; feature] ([2 H] in), then the MLP."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        H = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        heads, kv, D = config.num_attention_heads, config.num_key_value_heads, self.self_attn.head_dim
        bias = config.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * H, heads * D, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * H, kv * D, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * H, kv * D, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, features, position_embeddings, attention_mask, cache, **kwargs) -> torch.Tensor:
        """embeds, features [B, T, H] -> the layer's output [B, T, H] (pre-norm)."""
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        h = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        h, _ = self.self_attn(h, position_embeddings, attention_mask, cache, **kwargs)
        h = residual + h
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(LlamaPreTrainedModel):
    """The head as a causal LM a CachedLM runs: forward(input_ids, ..., features [B, T, H]) -> logits over
    the draft vocabulary [B, T', dv] (column i is target id logit_columns()[i]) and, as hidden_states, its
    pre-norm output [B, T, H] (what it reads as the feature of the next depth)."""

    # kept in float where drafts run in int8 (specdec.cpu_linear.quantize_linears): fc reads the target's hidden
    # states as they are, not normalized, whose outlier features would set one scale for all the others
    float_linears = ("fc",)

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        H, V, dv = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, dv, bias=False)
        self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long, device=HOST), persistent=True)  # moved with the module
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.config.eagle_config["eagle_aux_hidden_state_layer_ids"])

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        """The head's own dtype (its norm's), whatever a shared embedding's is."""
        return self.norm.weight.dtype

    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] each draft id's id in the target's vocabulary."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def logit_columns(self) -> torch.Tensor:
        """[dv] the target id of each column of its logits (specdec.drafters.logit_columns)."""
        return self.target_ids()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [..., 3 Ht] -> the head's features [..., H]."""
        return self.fc(features.to(weight_dtype(self.fc)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, features=None,
                logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        kwargs.pop("use_cache", None), kwargs.pop("output_hidden_states", None)
        prenorm = self.layer_output(input_ids, features, attention_mask, position_ids, cache, **kwargs)  # [B, T, H]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.draft_logits(prenorm[:, keep]), hidden_states=(prenorm,))

    def layer_output(self, input_ids, features, attention_mask, position_ids, cache=None, **kwargs) -> torch.Tensor:
        """The tokens [B, T] and their features [B, T, H] through the head's layer -> its pre-norm output [B, T, H]."""
        embeds = self.embed_tokens(input_ids).to(self.dtype)  # [B, T, H]; a shared embedding may be the target's dtype
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(embeds, position_ids=position_ids)
        return self.midlayer(embeds, features, position_embeddings, attention_mask, cache, **kwargs)

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The head's output [..., H] -> logits over the draft vocabulary [..., dv]."""
        return self.lm_head(self.norm(prenorm))


def head_config(target_config, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None) -> LlamaConfig:
    """A head's config for this target: its hidden size, heads and vocabulary; one layer."""
    tc = target_config.get_text_config()
    aux = list(aux_layers or default_aux_layers(tc.num_hidden_layers))
    return LlamaConfig(
        architectures=[ARCHITECTURES[0]], vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size,
        hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads), rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=dict(tc.rope_parameters), max_position_embeddings=tc.max_position_embeddings,
        hidden_act=tc.hidden_act, tie_word_embeddings=False, eagle_config={"eagle_aux_hidden_state_layer_ids": aux},
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def load_head(path: str | Path, target: PreTrainedModel, dtype: torch.dtype | None = None) -> Eagle3Head:
    """The EAGLE-3 head in `path` for this target, on its device and in `dtype` (default: the target's); without
    embed_tokens of its own it shares the target's input embedding, in the target's dtype (the rows it reads are
    cast). HeadMismatch for a head made for another target."""
    path = Path(path)
    config = read_config(path, target.config)
    config._attn_implementation = "sdpa"
    weights = {k.removeprefix("model."): v for k, v in _read_weights(path).items()}
    weights.pop("t2d", None)
    with torch.device("meta"):
        head = Eagle3Head(config)
    shared = "embed_tokens.weight" not in weights
    _check_layout(head.state_dict(), weights, shared, path)  # on the meta device: nothing sized from the config yet
    head = head.to_empty(device=target.device).to(dtype or target.dtype)
    head.rotary_emb = LlamaRotaryEmbedding(config=config).to(target.device)  # its inv_freq: not in the weights
    if shared:
        head.embed_tokens = target.get_input_embeddings()
    head.load_state_dict(weights, strict=False)
    head.d2t.copy_(weights["d2t"].long())
    _check_mapping(head, path)
    return head.eval()


def _check_layout(state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], shared: bool, path) -> None:
    """HeadMismatch unless the weights are the head's (its state on any device: names and shapes), embed_tokens
    aside where it shares the target's."""
    missing = sorted(k for k in state if k not in weights and not (shared and k.startswith("embed_tokens.")))
    extra = sorted(k for k in weights if k not in state)
    if missing or extra:
        raise HeadMismatch(f"the head in {str(path)!r} is not in EAGLE-3's layout: missing {missing[:4]}, "
                           f"unexpected {extra[:4]}")
    for name, tensor in weights.items():
        if state[name].shape != tensor.shape:
            raise HeadMismatch(f"the head in {str(path)!r}: {name} is {tuple(tensor.shape)}, expected "
                               f"{tuple(state[name].shape)} from its config")


def _check_mapping(head: Eagle3Head, path) -> None:
    ids = head.target_ids()
    if ids.min() < 0 or ids.max() >= head.config.vocab_size or ids.unique().numel() != ids.numel():
        raise HeadMismatch(f"the head in {str(path)!r}: d2t maps draft ids outside the target's vocabulary "
                           f"[0, {head.config.vocab_size}) or two onto one")


def save_head(head: Eagle3Head, path: str | Path, include_embedding: bool = False) -> None:
    """Write the head in EAGLE-3's published layout (config.json, model.safetensors with midlayer.*, fc, norm,
    lm_head, d2t, t2d), which vLLM and SGLang load; the embedding only when asked (else the target's is used)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config["architectures"] = [ARCHITECTURES[0]]
    for private in ("_attn_implementation", "_attn_implementation_internal"):
        config.pop(private, None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
             if include_embedding or not k.startswith("embed_tokens.")}
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool, device=HOST)  # written to the file
    t2d[head.target_ids().cpu()] = True
    save_file({**state, "t2d": t2d}, path / "model.safetensors")
