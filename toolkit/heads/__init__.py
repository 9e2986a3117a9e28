"""Draft heads for speculative decoding, trained on the target's own hidden states.

Modules: ``data`` (chat rendering, loss masks, self-distillation), ``hidden_states`` (cached / online target hidden
states), ``medusa`` (Medusa heads and loss), ``eagle`` (EAGLE-1 and EAGLE-3 heads, their losses, the training-time
test, the draft vocabulary), ``eagle_draft`` (an EAGLE head drafting chains and EAGLE-2 trees in ``toolkit.decode``),
``train`` (the training loop and its ``TrainConfig``; gradient all-reduce under torchrun), ``medusa_export`` /
``eagle_export`` / ``speculators_export`` (engine layouts with key checks, serving flags), ``streamed_target`` (hidden
states one target layer at a time), ``options`` (what a user sets for ``compound train-heads``: Medusa's, EAGLE's,
data and selection options), ``kinds`` (the head registry: what each kind, medusa, eagle and eagle3, declares once),
``load`` (``load_head``: the one place that tells head directories apart). The phases of ``compound train-heads`` are
``toolkit.train_heads``.
"""
