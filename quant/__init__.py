"""Offline quantizer and the SGLang quantization method that routes layers to qflash.kernels."""
