"""TensorRT enums shared by the test stand-ins (plugin/trt_standin.py, runtime/fake_cuda.py): names and values of
NvInfer.h, the same in TensorRT 10.x / 11.x and TensorRT-RTX; test_trt_enums.py checks them against the real
`tensorrt_rtx` module."""

import enum


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10
    E8M0 = 11
