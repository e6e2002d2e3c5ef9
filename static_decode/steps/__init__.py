"""The device steps: fixed-shape prefill, decode and verify functions over the step buffers, sampling, speculative
drafting."""
