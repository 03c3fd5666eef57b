"""GPU execution: the bf16 model forward built from `gpu_engine.kernels` and the CUDA graph cache."""
