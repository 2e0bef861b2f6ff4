"""A minimal stand-in of TensorRT's native core module (`tensorrt`), under which the REAL pure-Python
`tensorrt.plugin` package of a TensorRT bindings wheel runs, plus the part of TensorRT's builder that drives
a quickly deployable AOT plugin. It implements only what tensorrt.plugin and our register.py touch, and it
enforces the C++ API's contracts where the pybind layer would: types of every argument, symbolic dimension
expressions built only through the expression builder, launch parameters and extra arguments only as
int32 ISymExprs, one creator per (name, version, namespace).

Enum values are NvInfer.h's (10.9 .. 11.4 agree on every one used here). The plugin package comes from the
wheel (see conftest.py `trt_plugin`); nothing of it is stored in this repository.
"""

from __future__ import annotations

import enum
import types
from pathlib import Path
from typing import Any

import numpy as np
from trt_enums import DataType  # tests/: shared with runtime/fake_cuda.py


class TensorFormat(enum.IntEnum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    DHWC8 = 6
    CDHW32 = 7
    HWC = 8
    DLA_LINEAR = 9
    DLA_HWC4 = 10
    HWC16 = 11
    DHWC = 12


class DimensionOperation(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4
    EQUAL = 5
    LESS = 6
    FLOOR_DIV = 7
    CEIL_DIV = 8


class PluginFieldType(enum.IntEnum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    BF16 = 9
    INT64 = 10
    FP8 = 11
    INT4 = 12
    FP4 = 13


class QuickPluginCreationRequest(enum.IntEnum):
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class TensorRTPhase(enum.IntEnum):
    BUILD = 0
    RUNTIME = 1


class PluginArgType(enum.IntEnum):
    INT = 0


class PluginArgDataType(enum.IntEnum):
    INT8 = 0
    INT16 = 1
    INT32 = 2


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}  # fmt: skip


def nptype(dtype: DataType) -> type:
    if dtype not in _NP:
        raise TypeError(f"Could not resolve TensorRT datatype to an equivalent numpy datatype: {dtype!r}")
    return _NP[dtype]


def _require(value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """What pybind11 does with an argument of the wrong type: a TypeError."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{what}: incompatible argument type {type(value).__name__}")


# ---- symbolic dimensions -------------------------------------------------------------------------------


class IDimensionExpr:
    """A node of a symbolic expression: a constant, a named dimension (known only at run time), or an op."""

    def __init__(self, op: DimensionOperation | None = None, args: tuple = (), value: int | None = None,
                 name: str | None = None):  # fmt: skip
        self._op, self._args, self._value, self._name = op, args, value, name

    def is_constant(self) -> bool:
        return self._value is not None

    def get_constant_value(self) -> int:
        if self._value is None:
            raise RuntimeError(f"{self!r} is not a build-time constant")
        return self._value

    def is_size_tensor(self) -> bool:
        return False

    def evaluate(self, env: dict[str, int]) -> int:
        """The value once the runtime knows every named dimension (`env`)."""
        if self._value is not None:
            return self._value
        if self._name is not None:
            return env[self._name]
        a, b = (x.evaluate(env) for x in self._args)
        return _apply(self._op, a, b)

    def __repr__(self) -> str:
        if self._value is not None:
            return str(self._value)
        if self._name is not None:
            return self._name
        return f"{self._op.name}({self._args[0]!r}, {self._args[1]!r})"


def _apply(op: DimensionOperation, a: int, b: int) -> int:
    if op in (DimensionOperation.FLOOR_DIV, DimensionOperation.CEIL_DIV) and b == 0:
        raise ZeroDivisionError(f"{op.name} by zero in a shape expression")
    return {
        DimensionOperation.SUM: lambda: a + b, DimensionOperation.PROD: lambda: a * b,
        DimensionOperation.MAX: lambda: max(a, b), DimensionOperation.MIN: lambda: min(a, b),
        DimensionOperation.SUB: lambda: a - b, DimensionOperation.EQUAL: lambda: int(a == b),
        DimensionOperation.LESS: lambda: int(a < b), DimensionOperation.FLOOR_DIV: lambda: a // b,
        DimensionOperation.CEIL_DIV: lambda: -(-a // b),
    }[op]()  # fmt: skip


class IExprBuilder:
    """Builds and constant-folds expressions; the only way to make one, as in TensorRT."""

    def __init__(self) -> None:
        self.made = 0

    def constant(self, value: int) -> IDimensionExpr:
        _require(value, int, "IExprBuilder.constant")
        self.made += 1
        return IDimensionExpr(value=value)

    def operation(self, op: DimensionOperation, first: IDimensionExpr, second: IDimensionExpr) -> IDimensionExpr:
        _require(op, DimensionOperation, "IExprBuilder.operation(op)")
        _require(first, IDimensionExpr, "IExprBuilder.operation(first)")
        _require(second, IDimensionExpr, "IExprBuilder.operation(second)")
        self.made += 1
        if first.is_constant() and second.is_constant():
            return IDimensionExpr(value=_apply(op, first.get_constant_value(), second.get_constant_value()))
        return IDimensionExpr(op, (first, second))

    @staticmethod
    def dimension(name: str) -> IDimensionExpr:
        """A dimension the network leaves open (batch, sequence): what TensorRT hands the plugin."""
        return IDimensionExpr(name=name)


class DimsExprs:
    def __init__(self, n: int):
        _require(n, int, "DimsExprs")
        self._d: list[IDimensionExpr | None] = [None] * n

    def __len__(self) -> int:
        return len(self._d)

    def __getitem__(self, i: int) -> IDimensionExpr:
        d = self._d[i]
        assert d is not None, "DimsExprs entry read before it was set"
        return d

    def __setitem__(self, i: int, value: IDimensionExpr) -> None:
        _require(value, IDimensionExpr, "DimsExprs.__setitem__")
        self._d[i] = value


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, shape: int | tuple = ()):
        if isinstance(shape, int):
            shape = (0,) * shape
        if len(shape) > cls.MAX_DIMS:
            raise ValueError(f"Dims: at most {cls.MAX_DIMS} dimensions")
        return super().__new__(cls, shape)


class PluginTensorDesc:
    def __init__(self) -> None:
        self.type, self.format, self.dims, self.scale = DataType.FLOAT, TensorFormat.LINEAR, Dims(), 1.0

    def __setattr__(self, name: str, value: Any) -> None:
        kinds = {"type": DataType, "format": TensorFormat, "dims": Dims, "scale": float}
        if name not in kinds:
            raise AttributeError(f"PluginTensorDesc has no attribute {name!r}")
        _require(value, kinds[name], f"PluginTensorDesc.{name}")
        object.__setattr__(self, name, value)


class DynamicPluginTensorDesc:
    def __init__(self) -> None:
        self.desc, self.min, self.opt, self.max = PluginTensorDesc(), Dims(), Dims(), Dims()


class PluginField:
    def __init__(self, name: str = "", data: Any = None, type: PluginFieldType = PluginFieldType.UNKNOWN):
        _require(name, str, "PluginField(name)")
        _require(type, PluginFieldType, "PluginField(type)")
        self.name, self.data, self.type = name, data, type
        self.size = 0 if data is None else len(data)


class PluginFieldCollection(list):
    def __init__(self, fields: list | tuple = ()):
        for f in fields:
            _require(f, PluginField, "PluginFieldCollection")
        super().__init__(fields)


class ITensor:
    pass


class _Interface:
    def __init__(self) -> None:  # pybind trampolines need their __init__ called; nothing else here
        pass


class IPluginV3(_Interface):
    pass


class IPluginV3QuickCore(_Interface):
    pass


class IPluginV3QuickBuild(_Interface):
    pass


class IPluginV3QuickRuntime(_Interface):
    pass


class IPluginV3QuickAOTBuild(_Interface):
    pass


class IPluginCreatorV3Quick(_Interface):
    pass


class ISymExpr(_Interface):
    """One extra kernel argument or launch dimension: type, dtype and the IDimensionExpr, set by tensorrt.plugin."""


class PluginRegistry:
    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], IPluginCreatorV3Quick] = {}

    def register_creator(self, creator: IPluginCreatorV3Quick, namespace: str) -> bool:
        _require(creator, IPluginCreatorV3Quick, "IPluginRegistry.register_creator")
        key = (creator.name, creator.plugin_version, namespace)
        assert namespace == creator.plugin_namespace, (namespace, creator.plugin_namespace)
        if key in self.creators:
            return False  # TensorRT logs an error and refuses a second creator with the same key
        self.creators[key] = creator
        return True

    def get_creator(self, name: str, version: str, namespace: str = "") -> IPluginCreatorV3Quick | None:
        return self.creators.get((name, version, namespace))

    @property
    def all_creators(self) -> list:
        return list(self.creators.values())


class Logger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = Severity

    messages: list[tuple[int, str]] = []

    def __init__(self, min_severity: int = Severity.WARNING):
        self.min_severity = min_severity

    def log(self, severity: int, msg: str) -> None:
        Logger.messages.append((int(severity), msg))


def core_module(version: str, package_root: Path) -> types.ModuleType:
    """The stand-in `tensorrt` module; `package_root` holds the wheel's `plugin/` folder."""
    mod = types.ModuleType("tensorrt")
    mod.__path__ = [str(package_root)]
    mod.__version__ = version
    registry = PluginRegistry()
    names = dict(
        DataType=DataType, TensorFormat=TensorFormat, DimensionOperation=DimensionOperation,
        PluginFieldType=PluginFieldType, QuickPluginCreationRequest=QuickPluginCreationRequest,
        TensorRTPhase=TensorRTPhase, PluginArgType=PluginArgType, PluginArgDataType=PluginArgDataType,
        IDimensionExpr=IDimensionExpr, IExprBuilder=IExprBuilder, DimsExprs=DimsExprs, Dims=Dims,
        PluginTensorDesc=PluginTensorDesc, DynamicPluginTensorDesc=DynamicPluginTensorDesc, PluginField=PluginField,
        PluginFieldCollection=PluginFieldCollection, ITensor=ITensor, IPluginV3=IPluginV3,
        IPluginV3QuickCore=IPluginV3QuickCore, IPluginV3QuickBuild=IPluginV3QuickBuild,
        IPluginV3QuickRuntime=IPluginV3QuickRuntime, IPluginV3QuickAOTBuild=IPluginV3QuickAOTBuild,
        IPluginCreatorV3Quick=IPluginCreatorV3Quick, ISymExpr=ISymExpr, Logger=Logger, nptype=nptype,
        get_plugin_registry=lambda: registry,
        float32=DataType.FLOAT, float16=DataType.HALF, bfloat16=DataType.BF16, int8=DataType.INT8,
        int32=DataType.INT32, int64=DataType.INT64, bool=DataType.BOOL, uint8=DataType.UINT8, fp8=DataType.FP8,
        int4=DataType.INT4,
    )  # fmt: skip
    for k, v in names.items():
        setattr(mod, k, v)
    return mod


# ---- the builder's side ----------------------------------------------------------------------------------


class LaunchParams:
    """What TensorRT passes to get_launch_params: every field takes an int32 ISymExpr of a shape expression."""

    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams has no field {name!r}")
        _check_sym(value, f"launch param {name}")
        object.__setattr__(self, name, value)


class SymExprSetter:
    """The extra kernel arguments: nbSymExprs first, then each one, an int32 ISymExpr."""

    def __init__(self) -> None:
        self._n: int | None = None
        self.args: list[ISymExpr | None] = []

    @property
    def nbSymExprs(self) -> int:  # noqa: N802 (TensorRT's name)
        return self._n or 0

    @nbSymExprs.setter
    def nbSymExprs(self, n: int) -> None:  # noqa: N802
        _require(n, int, "nbSymExprs")
        self._n, self.args = n, [None] * n

    def __setitem__(self, i: int, value: ISymExpr) -> None:
        assert self._n is not None and 0 <= i < self._n, f"extra argument {i} set before nbSymExprs ({self._n})"
        _check_sym(value, f"extra argument {i}")
        self.args[i] = value


def _check_sym(value: Any, what: str) -> None:
    _require(value, ISymExpr, what)
    assert value.type == PluginArgType.INT and value.dtype == PluginArgDataType.INT32, (what, value.type, value.dtype)
    _require(value.expr, IDimensionExpr, f"{what}.expr")


def dynamic_desc(dtype: DataType, dims: tuple[int, ...], fmt: TensorFormat = TensorFormat.LINEAR) -> DynamicPluginTensorDesc:
    d = DynamicPluginTensorDesc()
    d.desc.type, d.desc.format, d.desc.dims = dtype, fmt, Dims(dims)
    d.min = d.opt = d.max = Dims(tuple(1 if x < 0 else x for x in dims))
    return d
