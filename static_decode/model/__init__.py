"""The model: configuration, rotary tables, the Llama-family network, its projections (float, quantized,
tensor-parallel) and the fused CPU decode layers."""
