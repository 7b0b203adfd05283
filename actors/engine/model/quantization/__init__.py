"""Quantized execution of a loaded transformers model (``EngineConfig.quantization``):
``fp8_linear`` (the FP8 projection layer), ``fp8_checkpoint`` (which checkpoints load and how
their scales are read), ``fp8_model`` (the device check and the swap into the decoder layers).
See docs/fp8.md."""
