"""Loading checkpoints: save_pretrained directories, quantized checkpoints, weights on huge pages."""
