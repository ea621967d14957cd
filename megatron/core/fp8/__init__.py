"""FP8 training in pure PyTorch: quantisation (quantization.py), recipes and the FP8 region (recipe.py), which
layers run in FP8 (context.py). The FP8 GEMM of the parallel linear layers is tensor_parallel/fp8_linear.py;
docs/fp8.md describes the whole."""
