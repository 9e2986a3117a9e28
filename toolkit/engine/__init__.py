"""The engine's plumbing: how a model is walked layer by layer, whatever the quantization method.

| module | holds |
|---|---|
| ``loop`` | the layer-by-layer loop (capture inputs, run a driver per layer, next inputs), ``LayerSession`` |
| ``streaming`` | decoder layers read from safetensors shards when the loop reaches them (``--stream``) |
| ``shards`` | the safetensors index of a local model directory |
| ``offload`` | calibration activations kept on disk between layers (``--offload-activations``) |
| ``memory`` | the memory estimate of a run, and its refusal before any work |
| ``heap`` | handing freed memory back to the OS after each layer |
| ``distributed`` | the torchrun process group: join, reductions, barrier |
| ``devices`` | where a verb computes (``--device auto``: CUDA where present, else the CPU) |
| ``threads`` | how many threads torch computes on (``--threads auto`` or a count) |
"""
