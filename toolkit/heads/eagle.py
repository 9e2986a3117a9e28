"""EAGLE draft heads: one decoder layer that drafts from the target's own hidden states.

Two kinds (``EagleConfig.kind``), both a Llama decoder layer (``midlayer``) over the frozen target's embedding:

* ``eagle`` (EAGLE-1, arXiv 2401.15077; EAGLE-2 drafts with the same weights in a dynamic tree): the pair (final-norm
  hidden state f_t of token t, embedding of token t + 1) is fused by ``fc`` [H, 2H] (concat order: embedding, feature)
  and run through the layer (no input norm), which predicts f_{t+1}; the logits are the target's ``lm_head(f̂)``.
  Loss: smooth-L1 regression of f̂ onto f_{t+1} plus ``p_weight`` × the token loss (``token_loss``: KL against the
  target's distribution ``softmax(lm_head(f_{t+1}))``, or cross-entropy on its argmax); uniform noise on the input features (``noise`` × each token's RMS).
* ``eagle3`` (EAGLE-3, arXiv 2503.01840): ``fc`` [H, n·H] fuses the residual streams entering ``aux_layers`` of the
  target (transformers' ``hidden_states[i]``, which is vLLM's id i); the layer's attention reads
  concat(input_layernorm(embedding), hidden_norm(h)) [2H] with residual h; the logits are ``lm_head(norm(out))`` over
  a draft vocabulary of ``draft_vocab_size`` target ids (``d2t``: target id = draft id + d2t[draft id]; ``t2d``: bool
  over the target vocabulary). The next draft step feeds the layer's pre-norm output back as h (no fc).
  Training-time test (``eagle3_loss``): ``steps`` unrolled draft steps where step k reads the head's own output of
  step k - 1, with the attention that implies (``ttt_attention``); step k at position t predicts token t + 2 + k.

Positions follow vLLM's proposer: the pair (hidden of token t, token t + 1) sits at position t, and each further
draft step one position later, so the unrolled step k of pair t is trained at position t + k, where decoding puts it.

The target's embedding (and, for ``eagle``, its ``lm_head``) are attached with ``EagleHead.attach`` as non-persistent
buffers, and its RoPE frequencies as a float32 attribute: never trained, never saved, always the target's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.architectures import family
from toolkit.decode.model import apply_rope, rope_frequencies
from toolkit.heads.eagle_config import EAGLE3, VARIANTS, EagleConfig, check_family, default_aux_layers



# The layer type whose RoPE scheme a head takes from a target with one per layer type (Gemma 3): the global one, as
# the draft layer attends over the whole sequence.
HEAD_LAYER_TYPE = "full_attention"
# The token loss against the target: "kl", forward KL(target || draft) over the draft vocabulary (soft labels, the
# default of speculators); "ce", cross-entropy on the target's own greedy token (hard labels).
LOSSES = ("kl", "ce")


class RMSNorm(nn.Module):
    """weight · x / rms(x), normalised in float32 (Llama's)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config: EagleConfig, in_features: int):
        super().__init__()
        nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(in_features, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_features, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_features, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


# attend(q [B, nh, T, hd], k [B, nkv, T, hd], v [B, nkv, T, hd]) -> [B, nh, T, hd]: the caller's attention pattern
# (causal, training-time test, or a draft tree over a cache)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftLayer(nn.Module):
    """The head's decoder layer; tensor names are those of the EAGLE checkpoints (``midlayer.*``)."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        two_inputs = config.variant.reads_aux_layers  # embedding and hidden state side by side
        if two_inputs:
            self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn = _Attention(config, 2 * H if two_inputs else H)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.mlp = _MLP(config)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        """The layer's pre-norm output [B, T, H] for ``hidden`` [B, T, H] (and, for eagle3, ``embeds`` [B, T, H]);
        cos, sin [T, head_dim] (or [B, T, head_dim]) of each token's position."""
        c = self.config
        x = hidden
        if c.variant.reads_aux_layers:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        B, T, _ = x.shape
        attn = self.self_attn
        q = attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, c.num_attention_heads * c.head_dim))
        m = self.post_attention_layernorm(h)
        return h + self.mlp.down_proj(self.act(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class EagleHead(nn.Module):
    """``fc``, ``midlayer`` and, for eagle3, ``norm``, ``lm_head`` [V_d, H] and the vocabulary maps ``d2t`` / ``t2d``.

    Use: ``EagleHead.from_target(target, kind)`` for a new head, or ``EagleHead(config).attach(target)`` after loading
    weights. ``step`` runs the layer, ``logits`` reads its output.
    """

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.fc_inputs, H, bias=False)
        self.midlayer = DraftLayer(config)
        if config.variant.own_lm_head:
            self.norm = RMSNorm(H, config.rms_norm_eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        for name in ("embed", "target_lm_head"):
            self.register_buffer(name, None, persistent=False)
        self.inv_freq: torch.Tensor | None = None  # float32 always: not a buffer, so casting the head keeps it exact
        self.attention_scaling = 1.0

    @classmethod
    def from_target(cls, target: nn.Module, kind: str = EAGLE3.name, aux_layers: Sequence[int] | None = None,
                    draft_vocab: torch.Tensor | None = None) -> EagleHead:
        """A new head for ``target`` (its layer sizes), attached to it.

        draft_vocab: eagle3's target token ids (any order; default: the whole vocabulary). The eagle3 ``lm_head``
        starts random (normal, std the target's ``initializer_range``, as SpecForge's does) and ``norm`` as the
        target's final norm; ``fc`` and the layer start from PyTorch's default initialisation. Starting the
        ``lm_head`` from those rows of the target's instead trained worse heads on SmolLM2 (vLLM accepted length
        1.135-1.159 against 1.200-1.206 at 30 steps over three seeds, 1.44 against 1.50 at 300 steps;
        "Draft heads vs peers: what SpecForge's head had that compound's lacked" in docs/investigations.md).
        """
        c = target.config
        check_family(c.model_type, kind)
        variant = VARIANTS[kind]
        V = target.get_output_embeddings().weight.shape[0]
        vocab = torch.arange(V) if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long).unique()
        if variant.reads_aux_layers and aux_layers is None:
            aux_layers = default_aux_layers(c.num_hidden_layers)
        rope = {key: getattr(c, key) for key in ("rope_theta", "rope_scaling", "rope_parameters",
                                                 "max_position_embeddings") if getattr(c, key, None) is not None}
        if family(c.model_type).rope_by_layer_type:
            rope["rope_parameters"] = c.rope_parameters[HEAD_LAYER_TYPE]
        config = EagleConfig(
            kind=kind, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            vocab_size=V, draft_vocab_size=len(vocab) if variant.own_lm_head else V, rms_norm_eps=c.rms_norm_eps,
            # a Gemma target names its activation hidden_activation; the head, a Llama layer, keeps SiLU
            hidden_act=getattr(c, "hidden_act", EagleConfig.hidden_act),
            aux_layers=tuple(aux_layers or ()), target_layers=c.num_hidden_layers,
            rope=rope)
        head = cls(config)
        if variant.own_lm_head:
            with torch.no_grad():
                head.set_draft_vocab(vocab)
                head.lm_head.weight.normal_(0.0, getattr(c, "initializer_range", None) or 0.02)
                head.norm.weight.copy_(target.model.norm.weight.float())
        return head.attach(target)

    def attach(self, target: nn.Module) -> EagleHead:
        """Take the target's embedding, RoPE frequencies and (eagle) ``lm_head``, frozen; returns self."""
        embed = target.get_input_embeddings().weight
        if tuple(embed.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the head needs a target with vocabulary {self.config.vocab_size} and hidden size "
                             f"{self.config.hidden_size}; this one has {list(embed.shape)}")
        if getattr(target.config, "num_hidden_layers", 0) <= max(self.config.aux_layers, default=0):
            raise ValueError(f"aux_layers {list(self.config.aux_layers)} do not exist in a target of "
                             f"{target.config.num_hidden_layers} layers")
        dtype = self.fc.weight.dtype
        self.embed = embed.detach().to(dtype)
        if not self.config.variant.own_lm_head:
            self.target_lm_head = target.get_output_embeddings().weight.detach().to(dtype)
        layer_type = HEAD_LAYER_TYPE if family(target.config.model_type).rope_by_layer_type else None
        inv_freq, self.attention_scaling = rope_frequencies(target, layer_type)
        self.inv_freq = inv_freq.detach().float()
        return self

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Make ``d2t``/``t2d`` describe the draft vocabulary ``target_ids`` (sorted: draft id i = i-th smallest)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).unique()
        if ids.shape[0] != self.config.draft_vocab_size or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"the draft vocabulary needs {self.config.draft_vocab_size} distinct ids in "
                             f"[0, {self.config.vocab_size}), got {ids.shape[0]}")
        self.d2t.copy_(ids - torch.arange(ids.shape[0]))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (identity for eagle)."""
        return draft_ids + self.d2t[draft_ids] if self.config.variant.own_lm_head else draft_ids

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., head_dim] at integer ``positions`` [...]."""
        if self.inv_freq is None:
            raise RuntimeError("attach the head to its target first: head.attach(target)")
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.fc.weight.dtype
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The hidden state the first draft step reads from target ``features`` [..., feature_size]: eagle3's ``fc``
        over the concatenated layers; for eagle the feature itself (its ``fc`` fuses inside ``step``)."""
        features = features.to(self.fc.weight.dtype)
        return self.fc(features) if self.config.variant.reads_aux_layers else features

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft step: the layer's output [B, T, H] for hidden [B, T, H] paired with ``tokens`` [B, T] (the token
        after each hidden state's), at ``positions`` [T] or [B, T]."""
        embeds = F.embedding(tokens, self.embed)
        cos, sin = self.rope(positions)
        if not self.config.variant.reads_aux_layers:
            return self.midlayer(self.fc(torch.cat([embeds, hidden], dim=-1)), None, cos, sin, attend)
        return self.midlayer(hidden, embeds, cos, sin, attend)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits of the token after the one a step read: [..., V_d] over the draft vocabulary (eagle3) or
        [..., V] (eagle, through the target's ``lm_head``)."""
        if self.config.variant.own_lm_head:
            return self.lm_head(self.norm(out))
        return F.linear(out, self.target_lm_head)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, nkv, T, hd] -> [B, heads, T, hd] (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention (a draft step over a whole sequence)."""
    return F.scaled_dot_product_attention(q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), is_causal=True)


class TTTAttention:
    """Attention of the training-time test: step k's query at position t sees step 0's keys at positions <= t (the
    target's real features: the decoded prefix) and the keys of steps 1..k at position t alone (its draft ancestors
    and itself). Call once per step, in order; it keeps the keys and values of the steps so far."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, T = q.shape[1], q.shape[2]
        k, v = _expand_kv(k, heads), _expand_kv(v, heads)
        self.keys.append(k)
        self.values.append(v)
        scale = q.shape[-1] ** -0.5
        prefix = (q @ self.keys[0].transpose(-1, -2)) * scale  # (B, h, T, T)
        prefix = prefix.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in self.keys[1:]]  # each (B, h, T, 1)
        weights = torch.cat([prefix, *diagonal], dim=-1).float().softmax(-1).to(q.dtype)
        out = weights[..., :T] @ self.values[0]
        for j, value in enumerate(self.values[1:]):
            out = out + weights[..., T + j:T + j + 1] * value
        return out


def eagle3_step_outputs(head: EagleHead, features: torch.Tensor, input_ids: torch.Tensor,
                        steps: int) -> list[torch.Tensor]:
    """The unrolled draft of the training-time test: ``steps`` outputs [B, T, H]; output k at position t comes from
    the pair (target features at t, token t + 1) drafted k steps on, reading tokens t + 2 .. t + 1 + k (teacher
    forcing), and predicts token t + 2 + k. features: [B, T, n_aux, H]; input_ids: [B, T].
    """
    B, T = input_ids.shape
    hidden = head.fuse(features.flatten(-2))
    attend = TTTAttention()
    positions = torch.arange(T, device=input_ids.device)
    outputs = []
    for k in range(steps):
        tokens = F.pad(input_ids[:, 1 + k:], (0, 1 + k))  # token t + 1 + k at position t (0 past the end)
        hidden = head.step(hidden, tokens, positions + k, attend)
        outputs.append(hidden)
    return outputs


def token_loss(logits: torch.Tensor, target_logits: torch.Tensor, loss: str = "kl") -> torch.Tensor:
    """The summed token loss of draft ``logits`` [N, V] against the target's logits [N, V] (no gradient reaches the
    target): ``"kl"`` = sum of KL(softmax(target) || softmax(draft)); ``"ce"`` = cross-entropy on the target's
    argmax token. Both in float32."""
    if loss not in LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    log_q = logits.float().log_softmax(-1)
    target = target_logits.detach().float()
    if loss == "ce":
        return F.nll_loss(log_q, target.argmax(-1), reduction="sum")
    log_p = target.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum()


def _target_logits(final: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The target's logits ``final @ weight.T`` over the rows of ``weight``, no gradient."""
    with torch.no_grad():
        return F.linear(final.to(weight.dtype), weight)


def eagle3_loss(head: EagleHead, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                target_lm_head: torch.Tensor, steps: int = 4, decay: float = 0.8,
                loss: str = "kl") -> tuple[torch.Tensor, int, dict[str, float]]:
    """The training-time-test loss of one padded batch: sum over steps k of ``decay ** k`` × the summed
    ``token_loss`` (``loss``) of step k against the target's distribution over the draft vocabulary.

    hidden: [B, T, n_aux + 1, H], the aux layers then the final-norm state (what the target's ``lm_head`` reads);
    target_lm_head: [V, H]. A label counts where ``loss_mask`` marks it and it is in the draft vocabulary. Returns
    (loss sum, step-0 label count = ``loss_mask[:, 2:]`` in the draft vocabulary, metrics ``loss_k``,
    ``correct_k`` (draft argmax = target argmax), ``count_k``).
    """
    features, final = hidden[:, :, :-1], hidden[:, :, -1]
    outputs = eagle3_step_outputs(head, features, input_ids, steps)
    in_vocab = head.t2d[input_ids] & loss_mask
    vocab_rows = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=input_ids.device))
    draft_weight = target_lm_head[vocab_rows]
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    count0 = 0
    for k, out in enumerate(outputs):
        shift = k + 2
        if input_ids.shape[1] <= shift:
            break
        mask = in_vocab[:, shift:]  # label t + 2 + k for position t
        count = int(mask.sum())
        if k == 0:
            count0 = count
        if count == 0:
            continue
        logits = head.logits(out[:, :-shift][mask]).float()
        target = _target_logits(final[:, shift - 1:-1][mask], draft_weight)  # the target at t + 1 + k
        step_loss = token_loss(logits, target, loss)
        total = total + decay**k * step_loss
        metrics[f"loss_{k}"] = float(step_loss.detach())
        metrics[f"correct_{k}"] = float((logits.detach().argmax(-1) == target.argmax(-1)).sum())
        metrics[f"count_{k}"] = float(count)
    return total, count0, metrics


def eagle_loss(head: EagleHead, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               p_weight: float = 0.1, noise: float = 0.1,
               loss: str = "kl") -> tuple[torch.Tensor, int, dict[str, float]]:
    """EAGLE-1's loss on one padded batch: per label token, smooth-L1 (mean over H) of the predicted next feature
    plus ``p_weight`` × the ``token_loss`` (``loss``) against the target's next-token distribution; summed.

    hidden: [B, T, H] final-norm states. Pair t (feature t, token t + 1) predicts feature t + 1 and token t + 2; it
    counts where ``loss_mask[t + 2]``. Returns (loss sum, label count = ``loss_mask[:, 2:].sum()``, metrics
    ``loss_feature``, ``loss_token``, ``correct_0``, ``count_0``).
    """
    T = input_ids.shape[1]
    if T <= 2:
        return hidden.new_zeros((), dtype=torch.float32), 0, {}
    dtype = head.fc.weight.dtype
    features = hidden[:, :-1].to(dtype)
    if noise and head.training:
        rms = features.float().pow(2).mean(-1, keepdim=True).sqrt().to(dtype)
        features = features + (torch.rand_like(features) * 2 - 1) * noise * rms
    out = head.step(features, input_ids[:, 1:], torch.arange(T - 1, device=input_ids.device), causal_attention)
    mask = loss_mask[:, 2:]
    count = int(mask.sum())
    if count == 0:
        return hidden.new_zeros((), dtype=torch.float32), 0, {}
    predicted = out[:, :-1][mask]  # (N, H)
    actual = hidden[:, 1:-1][mask].to(dtype)
    feature_loss = F.smooth_l1_loss(predicted.float(), actual.float(), reduction="none").mean(-1).sum()
    logits = head.logits(predicted).float()
    target = _target_logits(actual, head.target_lm_head)
    tokens_loss = token_loss(logits, target, loss)
    metrics = {"loss_feature": float(feature_loss.detach()), "loss_token": float(tokens_loss.detach()),
               "correct_0": float((logits.detach().argmax(-1) == target.argmax(-1)).sum()), "count_0": float(count)}
    return feature_loss + p_weight * tokens_loss, count, metrics


def draft_vocabulary(label_ids: Sequence[torch.Tensor], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """(the ``size`` most frequent label tokens, sorted; the fraction of labels they cover). Ties and a shortfall of
    distinct labels are filled with the lowest token ids, so the result always has ``size`` ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in label_ids:
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices[:size]
    covered = counts[order].sum() / counts.sum().clamp(min=1)
    return order.sort().values, float(covered)
