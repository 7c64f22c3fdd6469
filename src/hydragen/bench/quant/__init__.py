"""GGUF weights computed in their own format (``bench quant``): kernels, accuracy, decode against
llama.cpp, memory, real model sizes."""
