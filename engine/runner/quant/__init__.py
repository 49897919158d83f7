"""Weight-only quantization (int8, int4): formats, quantized linear layers, model conversion."""

from engine.runner.quant.apply import QuantSummary, quantize_model

__all__ = ["QuantSummary", "quantize_model"]
