"""Draft heads for speculative decoding, trained on the target's own hidden states.

Modules: ``data`` (chat rendering, loss masks, self-distillation), ``hidden_states`` (cached / online target hidden
states), ``medusa`` (Medusa heads and loss), ``eagle`` (EAGLE-1 and EAGLE-3 heads, their losses, the training-time
test, the draft vocabulary), ``eagle_draft`` (an EAGLE head drafting chains and EAGLE-2 trees in ``toolkit.decode``),
``train`` (the training loop; gradient all-reduce under torchrun), ``export`` / ``eagle_export`` (engine layouts
with key checks, serving flags), ``acceptance`` (accepted length with ``toolkit.decode``), ``pipeline`` (the phases
of ``compound train-heads``).
"""
