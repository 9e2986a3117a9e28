"""A compact decoder forward for the Llama, Qwen, Phi-3, Gemma and Mixture-of-Experts families, with a static KV cache
and tree attention.

In the spirit of gpt-fast's ``model.py``: one readable forward, but built *over* a loaded transformers model. Every
linear is called as the model's own module (so a ``QuantLinear`` or any module with ``forward(x)`` just works; the
linears that share an input go through ``SharedInputLinears``, which runs int4 q/k/v or gate/up as one matmul; a
family that fuses them in one linear, Phi-3's ``qkv_proj`` and ``gate_up_proj``, has its output split by rows) and
every norm weight and the embedding are the model's tensors, shared and never copied. What this adds is what serving
needs and ``transformers`` does not expose simply: a preallocated KV cache (``toolkit.decode.kv_cache``), a forward
over a *tree* of candidate tokens (each node attends to the cached prefix and its own ancestors, at position
``start + depth``), and cache compaction to the accepted path (SpecInfer, arXiv 2305.09781 §4; Medusa, 2401.10774 §2.3).

Families differ only by data (``toolkit.architectures.FAMILIES``, whose docstring tables how each differs from Llama;
those with ``decode`` set run here; a Mixture-of-Experts layer runs the model's own sparse block, whose experts are
linears like any other), and everything else is read from the config: the window of each
``sliding_attention`` layer, and where the family's entry says so, the score scale (``query_pre_attn_scalar``), the
soft-caps of scores and logits (``c · tanh(x / c)``) and RoPE frequencies per layer type. Soft-capped scores run as an
explicit softmax (``scaled_dot_product_attention`` cannot cap), in fp32 as transformers' eager attention does.

RoPE: the static frequency schemes (default, linear, llama3, yarn) are read from the model's rotary module; schemes
whose frequencies change with the sequence length (dynamic NTK, longrope) are refused.

Two forwards compute the same layers. A float32 model with a float cache on a CPU runs the work between its linears
as a few C++ calls per layer (``toolkit.runtime.decode_step``: on SmolLM2 W4 that took a two-thread step from 13-15
to 7.7 ms, since the twenty-odd torch operations each cost more to dispatch than to compute); everything else,
every model where that file does not build, and a long prompt's prefill (``Decoder.torch_prefill_rows``) run the
torch forward, which stays the reference the C++ step is tested against. Both give a token the same bits decoded
alone as among a block's rows (see ``attention_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.architectures import UnsupportedFamily, family
from toolkit.decode.kv_cache import KVCache
from toolkit.decode.lm_head import RescoredHead
from toolkit.runtime import decode_step
from toolkit.runtime.quant_linear import QuantLinear, SharedInputLinears


class DecodeError(ValueError):
    """A model, cache or input the decoder cannot serve; the message says what to change."""


_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass
class _Layer:
    """One decoder layer: the model's own modules and tensors, its attention window (None = full) and the key of its
    RoPE table (the layer type where frequencies differ by type, else None).

    qkv / gate_up: q, k, v and gate, up as three and two linears, or one fused linear each (split by rows).
    post_attn_norm / post_mlp_norm: the norms of the attention and MLP outputs (Gemma 2/3), else None.
    experts: a Mixture-of-Experts layer's sparse block (the model's own module, routing included), run in place of
    gate_up and down_proj (then None); None for a dense layer.
    """

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    post_attn_norm: torch.Tensor | None
    post_mlp_norm: torch.Tensor | None
    qkv: SharedInputLinears
    o_proj: nn.Module
    gate_up: SharedInputLinears | None
    down_proj: nn.Module | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    window: int | None
    rope: str | None
    experts: nn.Module | None = None


class Decoder:
    """The forward of a supported causal LM over a static KV cache; build it with ``Decoder.from_model``.

    ``torch_prefill_rows``: a prompt of at least this many tokens run from slot 0 goes through the torch forward
    even where the C++ step runs. The C++ attention re-reads the cache for every row, so its cost grows with the
    square of a prefill's length while what it saves (some 11 ms of dispatch per forward on SmolLM2) does not: a
    512-token prompt took 1.5 s against the torch forward's 1.1 s, and the two estimates cross near 85 rows. This
    stays lossless: a prompt is prefilled from slot 0 by the same call in greedy and in speculative decoding, so both
    continue from the same cache bits, and every later forward (start > 0: single tokens, verification trees) runs
    the C++ step, which gives each row the same bits alone or in a block.
    """

    torch_prefill_rows = 64

    def __init__(self, model: nn.Module, max_len: int, kv_dtype: torch.dtype | None = None,
                 kv_scales: torch.Tensor | None = None, feature_layers: tuple[int, ...] | None = None,
                 fast_head: bool = False):
        config = model.config
        try:
            self.config, self.family = config, family(config.model_type, "decode")
        except UnsupportedFamily as err:
            raise DecodeError(f"toolkit.decode does not support model_type {config.model_type!r}; "
                              f"it decodes {', '.join(err.supported)}") from None
        base = model.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.lm_head = model.get_output_embeddings()
        if fast_head and self.lm_head.weight.dtype == torch.float32 and self.lm_head.weight.device.type == "cpu":
            self.lm_head = RescoredHead(self.lm_head)
        self.eps = config.rms_norm_eps
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        from transformers.activations import ACT2FN

        act_name = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma 2/3 name it so
        self.act, self.act_is_silu = ACT2FN[act_name], act_name in ("silu", "swish")
        self.embed_scale = (torch.tensor(config.hidden_size**0.5, dtype=self.dtype).item()
                            if self.family.embed_scale else 1.0)
        self.scale = (config.query_pre_attn_scalar if self.family.query_pre_attn_scalar else self.head_dim) ** -0.5
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None) if self.family.softcap else None
        self.final_softcap = getattr(config, "final_logit_softcapping", None) if self.family.softcap else None
        self.attn_dtype = attention_dtype(self.dtype)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(base.layers)]
        self.rope = {key: rope_frequencies(model, key) for key in {layer.rope for layer in self.layers}}
        if feature_layers is not None and (list(feature_layers) != sorted(set(feature_layers))
                                           or not all(0 <= i < len(self.layers) for i in feature_layers)):
            raise DecodeError(f"feature_layers {list(feature_layers)} must be increasing decoder-layer indices in "
                              f"[0, {len(self.layers)})")
        self.feature_layers = tuple(feature_layers) if feature_layers else None
        self.setup_cache(max_len, kv_dtype, kv_scales)

    def _layer(self, i: int, layer: nn.Module) -> _Layer:
        """Decoder layer ``i``'s modules and tensors, as the family's entry names them."""
        fam, config = self.family, self.config
        layer_types = getattr(config, "layer_types", None)
        sliding = layer_types is None or layer_types[i] == "sliding_attention"
        attn = layer.self_attn
        sparse = fam.experts is not None and hasattr(layer.mlp, "experts")  # Qwen's mlp_only_layers stay dense
        return _Layer(
            layer.input_layernorm.weight, layer.get_submodule(fam.mlp_norm).weight,
            layer.post_attention_layernorm.weight if fam.post_norms else None,
            layer.post_feedforward_layernorm.weight if fam.post_norms else None,
            SharedInputLinears([layer.get_submodule(name) for name in fam.qkv]), attn.o_proj,
            None if sparse else SharedInputLinears([layer.get_submodule(name) for name in fam.gate_up]),
            None if sparse else layer.mlp.down_proj,
            attn.q_norm.weight if fam.qk_norm else None, attn.k_norm.weight if fam.qk_norm else None,
            getattr(config, "sliding_window", None) if sliding else None,
            layer_types[i] if fam.rope_by_layer_type else None,
            layer.mlp if sparse else None,
        )

    @classmethod
    def from_model(cls, model: nn.Module, max_len: int, kv_dtype: torch.dtype | None = None,
                   kv_scales: torch.Tensor | None = None, feature_layers: tuple[int, ...] | None = None,
                   fast_head: bool = False) -> Decoder:
        """A decoder sharing ``model``'s modules and tensors, with a cache of ``max_len`` tokens.

        kv_dtype: None (the model dtype), a float dtype, or ``torch.int8``. kv_scales: [layers, 2] static INT8 scales
        (k, v) per layer; None computes them per token and head. feature_layers: return, instead of the final-norm
        hidden state, the residual streams entering these decoder layers, concatenated (what an EAGLE-3 head reads;
        index i is transformers' ``hidden_states[i]``). fast_head: a float32 LM head on the CPU runs as
        ``RescoredHead`` (a bf16 matmul with each row's top logits recomputed in float32): the same argmax, so the
        same greedy tokens, at about a third of the head's cost; the other logits carry bf16 error.
        """
        return cls(model, max_len, kv_dtype, kv_scales, feature_layers, fast_head)

    def prepare(self) -> None:
        """Pack every int4 linear for torch's CPU op now, so that the first forward (and its timing) does not."""
        for layer in self.layers:
            for group in (layer.qkv, layer.gate_up):
                if group is not None:
                    group.prepare()
            for module in (layer.o_proj, layer.down_proj, layer.experts):
                for linear in (module.modules() if module is not None else ()):
                    if isinstance(linear, QuantLinear):
                        linear.prepare()

    def setup_cache(self, max_len: int, kv_dtype: torch.dtype | None = None,
                    kv_scales: torch.Tensor | None = None) -> None:
        """(Re)allocate the KV cache and the RoPE table; call between runs to change capacity or cache dtype."""
        self.max_len = max_len
        self.cache = KVCache(len(self.layers), self.n_kv_heads, max_len, self.head_dim, self.dtype, kv_dtype,
                             kv_scales, self.device)
        step = decode_step.load() if self.dtype == torch.float32 and self.device.type == "cpu" else None
        usable = step is not None and not self.cache.quantized and self.head_dim % step.HEAD_STEP == 0
        self.native_step = step if usable else None  # None: the torch forward
        self.rope_tables = {}  # RoPE key → (cos, sin), each (max_len, head_dim)
        for key, (inv_freq, attention_scaling) in self.rope.items():
            freqs = torch.outer(torch.arange(max_len, device=self.device).float(), inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim): the rotate-half layout of HF checkpoints
            self.rope_tables[key] = ((emb.cos() * attention_scaling).to(self.dtype),
                                     (emb.sin() * attention_scaling).to(self.dtype))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, depth: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` [T] written at cache slots [start, start + T); return (logits [T, vocab], hidden [T, D]).

        Slots [0, start) must hold the prefix, with slot i at position i. Without a tree (``depth`` and ``tree_mask``
        None) the tokens are a causal chain at positions start + 0..T-1: prefill and single-token decode. With a tree,
        token j sits at position ``start + depth[j]`` and attends to the prefix and to the tokens i where
        ``tree_mask[j, i]`` (its ancestors and itself). ``hidden`` is the final-norm output that ``lm_head`` reads,
        or with ``feature_layers`` the residual streams entering those layers, concatenated: [T, len × D].
        """
        T = tokens.shape[0]
        end = start + T
        if end > self.max_len:
            raise DecodeError(f"{end} tokens do not fit the cache of max_len={self.max_len}; "
                              f"rebuild with Decoder.from_model(model, max_len>={end})")
        offsets = torch.arange(T, device=self.device) if depth is None else depth.to(self.device)
        positions = start + offsets
        rope = {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope_tables.items()}  # (T, hd)
        masks = {w: self._mask(start, positions, tree_mask, w) for w in {layer.window for layer in self.layers}}

        x = F.embedding(tokens.to(self.device), self.embed)  # (T, D)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        long_prefill = start == 0 and depth is None and T >= self.torch_prefill_rows
        layers = self._native_layers if self.native_step is not None and not long_prefill else self._torch_layers
        hidden, features = layers(x, start, rope, masks)
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.feature_layers:
            return logits, torch.cat(features, dim=-1)
        return logits, hidden

    __call__ = forward

    def _torch_layers(self, x: torch.Tensor, start: int, rope: dict, masks: dict
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every decoder layer and the final norm in torch operations: (hidden [T, D], the feature-layer inputs)."""
        features = []
        for i, layer in enumerate(self.layers):
            if self.feature_layers and i in self.feature_layers:
                features.append(x)
            attended = self._attention(i, layer, self._rms_norm(x, layer.attn_norm), start, *rope[layer.rope],
                                       masks[layer.window])
            if layer.post_attn_norm is not None:
                attended = self._rms_norm(attended, layer.post_attn_norm)
            x = x + attended
            out = self._mlp(layer, self._rms_norm(x, layer.mlp_norm))
            if layer.post_mlp_norm is not None:
                out = self._rms_norm(out, layer.post_mlp_norm)
            x = x + out
        return self._rms_norm(x, self.norm), features

    def _native_layers(self, x: torch.Tensor, start: int, rope: dict, masks: dict
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``_torch_layers`` through ``toolkit.runtime.decode_step``: a few C++ calls between the linears, float32
        attention computed row by row (the same bits alone or in a block, as float64 gives the torch forward)."""
        ops, eps, offset = self.native_step, self.eps, float(self.family.norm_offset)
        features = []
        h = ops.rms_norm(x, self.layers[0].attn_norm, eps, offset)
        for i, layer in enumerate(self.layers):
            if self.feature_layers and i in self.feature_layers:
                features.append(x)
            k_cache, v_cache = self.cache.k[i, 0], self.cache.v[i, 0]  # (KVH, max_len, hd)
            q = ops.rope_and_cache(layer.qkv.fused(h), *rope[layer.rope], k_cache, v_cache, start, self.n_heads,
                                   self.n_kv_heads, layer.q_norm, layer.k_norm, eps, offset)
            attended = layer.o_proj(ops.attention(q, k_cache, v_cache, start, masks[layer.window], self.scale,
                                                  self.attn_softcap or 0.0))
            if layer.post_attn_norm is not None:
                attended = ops.rms_norm(attended, layer.post_attn_norm, eps, offset)
            x, h = ops.add_rms_norm(x, attended, layer.mlp_norm, eps, offset)
            if layer.experts is not None:
                out = layer.experts(h[None])[0].contiguous()
            elif self.act_is_silu:
                out = layer.down_proj(ops.silu_mul(layer.gate_up.fused(h)))
            else:
                gate, up = layer.gate_up.fused(h).chunk(2, dim=-1)
                out = layer.down_proj(self.act(gate) * up)
            if layer.post_mlp_norm is not None:
                out = ops.rms_norm(out, layer.post_mlp_norm, eps, offset)
            x, h = ops.add_rms_norm(x, out, self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm,
                                    eps, offset)
        return h, features

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP of ``layer`` on x [T, D]: gated, or the sparse block of a Mixture-of-Experts layer."""
        if layer.experts is not None:
            return layer.experts(x[None])[0]
        gate, up = _parts(layer.gate_up(x), 2)
        return layer.down_proj(self.act(gate) * up)

    def _attention(self, i: int, layer: _Layer, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        T = x.shape[0]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = _parts(layer.qkv(x), 3, (q_size, kv_size, kv_size))
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv_heads, self.head_dim)
        v = v.reshape(T, self.n_kv_heads, self.head_dim)
        if self.family.qk_norm:
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        q = apply_rope(q.transpose(0, 1), cos, sin).unsqueeze(0)  # (1, H, T, hd)
        k = apply_rope(k.transpose(0, 1), cos, sin).unsqueeze(0)  # (1, KVH, T, hd)
        v = v.transpose(0, 1).unsqueeze(0)  # (1, KVH, T, hd)
        self.cache.write(i, start, k, v)
        k, v = self.cache.read(i, start + T)  # (1, KVH, start + T, hd)
        q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        if self.attn_softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.n_kv_heads != self.n_heads)  # (1, H, T, hd)
        else:
            out = self._capped_attention(q, k, v, mask)
        out = out.to(self.dtype)
        return layer.o_proj(out[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim))

    def _capped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(c · tanh(q·kᵀ · scale / c)) · v, the softmax in fp32 at least; q (1, H, T, hd), k and v (1, KVH, S, hd)."""
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (1, H, S, hd)
        scores = q @ k.transpose(-1, -2) * self.scale  # (1, H, T, S)
        scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.promote_types(q.dtype, torch.float32))
        return probs.to(q.dtype) @ v  # (1, H, T, hd)

    def _mask(self, start: int, positions: torch.Tensor, tree_mask: torch.Tensor | None,
              window: int | None) -> torch.Tensor | None:
        """Boolean [T, start + T] attention mask (True = attend), or None when every query sees every key."""
        T = positions.shape[0]
        if tree_mask is None and T == 1 and (window is None or start < window):
            return None
        own = (torch.ones(T, T, dtype=torch.bool, device=self.device).tril() if tree_mask is None
               else tree_mask.to(self.device, torch.bool))
        mask = torch.cat([torch.ones(T, start, dtype=torch.bool, device=self.device), own], dim=1)
        if window is not None:
            key_positions = torch.cat([torch.arange(start, device=self.device), positions])
            mask &= (positions[:, None] - key_positions[None, :]) < window
        return mask

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # in float32 as the checkpoints were trained; Llama casts back before the weight, Gemma after (HF PR 29402)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.family.norm_offset:
            return (x32 * (self.family.norm_offset + weight.float())).to(x.dtype)
        return weight * x32.to(x.dtype)


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the torch forward's attention of a ``dtype`` model computes in.

    float32 models: float64, so that a query's attention rounds to the same float32 whether it is computed alone
    (greedy decoding) or among the rows of a prefill or a speculative tree (verification). In float32, scores and
    sums take a reduction order that depends on the number of query rows (~1e-7 apart), and the int4 linears round
    their input to bf16, which turns such a difference into a different bf16 value now and then, then a different
    token: on an AVX2 CPU (no AVX-512) SmolLM2 W4's hidden states differed by up to 0.4 between a 10-token block
    and one token at a time, and speculative decoding was not lossless. In float64 the two agree bit for bit
    (tests/decode/test_model.py), at no measurable cost on SmolLM2 (attention is a few % of a step).

    The C++ step of float32 models (``toolkit.runtime.decode_step``) needs no float64: it computes each row alone, in
    one fixed order, so it attends in float32.

    Other dtypes: the model dtype, as vLLM's CPU backend computes it. Upcasting a bf16 model's attention would move
    bf16 greedy paths away from vLLM's: in fp32 the EAGLE-3 W4 acceptance predicted for vLLM fell from 1.47 to 1.27
    against vLLM's 1.53 (tests/integration/test_vllm_eagle).
    """
    return torch.float64 if dtype == torch.float32 else dtype


def _parts(outputs: tuple[torch.Tensor, ...], n: int, sizes: tuple[int, ...] | None = None
           ) -> tuple[torch.Tensor, ...]:
    """The ``n`` outputs of linears sharing an input: as they are, or one fused output split by rows (into ``sizes``,
    or ``n`` equal parts)."""
    if len(outputs) == n:
        return outputs
    (fused,) = outputs
    return fused.split(list(sizes), dim=-1) if sizes else fused.chunk(n, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [heads, T, head_dim] in the rotate-half layout; cos, sin [T, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_frequencies(model: nn.Module, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention_scaling) of a static RoPE scheme, taken from the model's rotary module;
    with ``layer_type``, that layer type's scheme (``rope_parameters`` keyed by layer type, as Gemma 3 has)."""
    config = model.config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC_ROPE:
        raise DecodeError(f"RoPE type {rope_type!r} is not supported by toolkit.decode: its frequencies change with "
                          f"the sequence length; supported types are {', '.join(_STATIC_ROPE)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise DecodeError(f"partial_rotary_factor={partial} is not supported by toolkit.decode (RoPE over the whole "
                          "head only)")
    prefix = f"{layer_type}_" if layer_type else ""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, f"{prefix}inv_freq"):
        raise DecodeError(f"the model has no model.rotary_emb.{prefix}inv_freq; toolkit.decode needs "
                          "transformers>=4.56")
    return getattr(rotary, f"{prefix}inv_freq"), float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
