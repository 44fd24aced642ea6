"""Inference: Export to ONNX, INT8 quantization, Score Image Model (ONNX Runtime, in shards) and
Evaluate Model, with the scored tables' file formats."""
