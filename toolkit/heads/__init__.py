"""Draft heads for speculative decoding, trained on the target's own hidden states.

Modules: ``data`` (chat rendering, loss masks, self-distillation), ``hidden_states`` (cached / online target hidden
states), ``medusa`` (Medusa heads and loss), ``train`` (the training loop; DDP under torchrun), ``export`` (engine
layouts with key checks), ``acceptance`` (accepted length with ``toolkit.decode``).
"""
