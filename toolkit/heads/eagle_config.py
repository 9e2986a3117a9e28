"""What an EAGLE head is, before any weights: its generation (``EagleVariant``: EAGLE-1 or EAGLE-3, the facts that
set them apart, declared once), its shape (``EagleConfig``), the targets it can draft for (``check_family``) and
EAGLE-3's default feature layers. ``toolkit.heads.eagle`` builds the head from these; the layouts and the drafter
read the variant instead of comparing kind names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from toolkit.architectures import FAMILIES, UnsupportedFamily, family, supporting


@dataclass(frozen=True)
class EagleVariant:
    """What sets one EAGLE generation apart, declared once; ``EagleConfig.kind`` names it.

    reads_aux_layers: ``fc`` fuses the residual streams entering ``aux_layers`` once per draft, and the layer reads
    the embedding and the hidden state side by side [2H] (EAGLE-3); else ``fc`` fuses (embedding, feature) [2H] at
    every step and the layer reads its output [H] (EAGLE-1). own_lm_head: the head's own ``norm`` and ``lm_head``
    over a draft vocabulary (``d2t``/``t2d``); else the target's ``lm_head`` over the whole vocabulary.
    The EAGLE layout (``toolkit.heads.eagle_export``): ``disk_layer``, the layer's tensor prefix; ``fc_bias_on_disk``,
    a zero ``fc.bias`` that the layout stores; ``architectures``, its ``config.json``'s (the first names the variant).
    Serving: ``vllm_config``, keys vLLM's ``--speculative-config`` takes beside the method (the variant's name);
    ``sglang_algorithm`` and ``sglang_aux_layers`` (the aux-layer count SGLang's model reads; None: no aux layers).
    """

    name: str
    reads_aux_layers: bool
    own_lm_head: bool
    disk_layer: str
    fc_bias_on_disk: bool
    architectures: tuple[str, ...]
    vllm_config: tuple[tuple[str, object], ...]
    sglang_algorithm: str
    sglang_aux_layers: int | None


EAGLE1 = EagleVariant("eagle", reads_aux_layers=False, own_lm_head=False, disk_layer="layers.0",
                      fc_bias_on_disk=True, architectures=("LlamaForCausalLMEagle", "LlamaForCausalLM"),
                      vllm_config=(("draft_tensor_parallel_size", 1),), sglang_algorithm="EAGLE",
                      sglang_aux_layers=None)
EAGLE3 = EagleVariant("eagle3", reads_aux_layers=True, own_lm_head=True, disk_layer="midlayer",
                      fc_bias_on_disk=False, architectures=("LlamaForCausalLMEagle3",), vllm_config=(),
                      sglang_algorithm="EAGLE3",
                      sglang_aux_layers=3)  # SGLang's LlamaForCausalLMEagle3: fc = Linear(3 * hidden, hidden)
VARIANTS = {variant.name: variant for variant in (EAGLE1, EAGLE3)}


def check_family(model_type: str | None, kind: str) -> None:
    """ValueError, naming the families that take them, unless ``kind`` heads can draft for ``model_type``
    (``Family.eagle``)."""
    try:
        if kind in family(model_type, "eagle").eagle:
            return
    except UnsupportedFamily:
        pass
    supported = [name for name in supporting("eagle") if kind in FAMILIES[name].eagle]
    raise ValueError(f"EAGLE heads ({kind}) for model_type {model_type!r} are not supported; supported: "
                     f"{', '.join(supported)}")


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE head; sizes default to the target's decoder layer (``from_target``).

    aux_layers: ``eagle3`` only, increasing indices into transformers' ``hidden_states`` (the residual stream entering
    that decoder layer; vLLM's numbering). target_layers: the target's decoder-layer count. rope: the target's RoPE
    parameters (``rope_theta``, ``rope_scaling``) and ``max_position_embeddings``, written into exports.
    """

    kind: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    aux_layers: tuple[int, ...] = ()
    target_layers: int = 0
    rope: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in VARIANTS:
            raise ValueError(f"EAGLE kind must be one of {', '.join(VARIANTS)}, got {self.kind!r}")
        if self.variant.reads_aux_layers:
            if not self.aux_layers or list(self.aux_layers) != sorted(set(self.aux_layers)):
                raise ValueError(f"{self.kind} needs increasing aux_layers, got {list(self.aux_layers)}")
            if self.target_layers and not all(0 < i < self.target_layers for i in self.aux_layers):
                raise ValueError(f"aux_layers {list(self.aux_layers)} must lie in [1, {self.target_layers}): the "
                                 f"residual stream entering a decoder layer of the target")
        elif self.aux_layers:
            raise ValueError(f"{self.kind} reads the final hidden state: no aux_layers")
        if self.variant.own_lm_head:
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        elif self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"{self.kind} drafts through the target's lm_head: draft_vocab_size = vocab_size")

    @property
    def variant(self) -> EagleVariant:
        """The EAGLE generation this head is (``kind``)."""
        return VARIANTS[self.kind]

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads per token."""
        return self.hidden_size * (len(self.aux_layers) if self.variant.reads_aux_layers else 1)

    @property
    def fc_inputs(self) -> int:
        """Width ``fc`` fuses: the aux layers' features, or (embedding, feature)."""
        return self.feature_size if self.variant.reads_aux_layers else 2 * self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self) | {"aux_layers": list(self.aux_layers)}

    @classmethod
    def from_dict(cls, raw: dict) -> EagleConfig:
        return cls(**{**raw, "aux_layers": tuple(raw.get("aux_layers", ()))})


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: (2, N // 2, N - 3), vLLM's and EAGLE's default (fewer when they
    coincide, in targets of under 8 layers)."""
    return tuple(sorted({i for i in (2, num_layers // 2, num_layers - 3) if 0 < i < num_layers}))
