"""TensorRT and TensorRT-RTX engines: the builder, its optimization profiles and compatibility checks."""
