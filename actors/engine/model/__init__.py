"""Model execution on the device: loading a transformers model onto the engine's attention
function (``loader``), the paged KV cache, packing a step's inputs and running the forward
(``runner``, ``staging``, ``block_table``), CUDA graphs, the fused layers and fused MoE
(``fused_layers``, ``moe``) with their Triton kernels (``kernels``), and the attention backends
(``attention``)."""
