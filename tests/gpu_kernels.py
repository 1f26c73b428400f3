"""What DALI 2.4's GPU kernels take: the input dtypes (and, where the kernel needs one, layouts) of every
operator dalifeed's graphs put on the GPU (`gpu` and `hybrid` devices, `mixed` decoders included).

A GPU operator picks its kernel at run time with a `TYPE_SWITCH` over a fixed list of types and fails the batch
("Unsupported data type") on any other, while the same operator's CPU backend often lists more: DALI 2.4's CPU
`fn.erase` takes float16 and its GPU `fn.erase` does not, so an fp16 graph that erased after normalising ran on
every CPU and failed on the first GPU batch (issue 28). `make gpu-lint` (tests/test_gpu_graphs.py) runs each
graph's `cpu` twin once, reads the dtype and layout every operator receives, and holds the operators of the
`gpu` and `hybrid` graphs to this table (docs/development/gpu-evidence.md, "Every GPU kernel gets a dtype it has").

Each row gives the DALI source file and the list the GPU backend switches over (`NVIDIA/DALI`, read through the
search index; the file's version there is not dated), and tests/test_gpu_graphs.py checks every row that has
a templated GPU kernel against the kernels instantiated in the installed 2.4.0 wheel's
`libdali_operators.so` (their mangled names), which is the 2.4 build itself.

Type names are `nvidia.dali.types.DALIDataType` names.
"""

from __future__ import annotations

from dataclasses import dataclass

UNSIGNED = ("UINT8", "UINT16", "UINT32", "UINT64")
SIGNED = ("INT8", "INT16", "INT32", "INT64")


@dataclass(frozen=True)
class GpuKernel:
    """What the GPU backend of one operator (DALI schema name) takes."""

    types: frozenset[str] | None  # input dtypes it has a kernel for; None: any (it copies elements by size)
    source: str  # the DALI file and the list its GPU backend switches over
    layouts: tuple[str, ...] | None = None  # input layouts it takes; None: not restricted (or not checked)
    inputs: int | None = 1  # how many leading regular inputs `types` applies to (None: every input)


def _kernel(types, source: str, **rest) -> GpuKernel:
    return GpuKernel(None if types is None else frozenset(types), source, **rest)


DECODER = _kernel(("UINT8",), "dali/operators/imgcodec/image_decoder.h: the encoded file, as the bytes the readers "
                              "give (the `mixed` decoder's input stays on the CPU)")
WARP = _kernel(("UINT8", "INT16", "INT32", "FLOAT"),
               "dali/operators/image/remap/warp.h: Warp::DefaultSupportedTypes, (output, input) pairs of uint8_t, "
               "int16_t, int32_t with themselves and float; channels interleaved last (SpatialDim = ndim - 1)",
               layouts=("HWC",))
REDUCE = _kernel((*UNSIGNED, *SIGNED, "FLOAT"),
                 "dali/operators/generic/reduce/reduce.h: REDUCE_TYPES (uint8_t, int8_t, uint16_t, int16_t, uint32_t, "
                 "int32_t, uint64_t, int64_t, float): no float16")
SPLIT_MERGE = _kernel(None, "dali/pipeline/operator/builtin/conditional/split_merge.h: copies whole samples")
CAST = _kernel(("BOOL", *UNSIGNED, *SIGNED, "FLOAT16", "FLOAT", "FLOAT64"),
               "dali/operators/generic/cast.h: CAST_ALLOWED_TYPES (bool, uint8_t .. int64_t, float16, float, double)")

BRIGHTNESS_CONTRAST = _kernel(("UINT8", "INT16", "INT32", "FLOAT"),
                              "dali/operators/image/color/brightness_contrast.cu: TYPE_SWITCH over the input type "
                              "(uint8_t, int16_t, int32_t, float), and over the output type the same list")

GPU_KERNELS: dict[str, GpuKernel] = {
    "decoders__Image": DECODER,
    "decoders__ImageRandomCrop": DECODER,
    "decoders__ImageSlice": DECODER,
    "Resize": _kernel(("UINT8", "INT16", "UINT16", "FLOAT"),
                      "dali/operators/image/resize/resize_base.cc: ResizeBase::SetupResize, TYPE_SWITCH (uint8_t, "
                      "int16_t, uint16_t, float) to the same type, (uint8_t, int16_t, uint16_t) to float"),
    "CropMirrorNormalize": _kernel(
        ("UINT8", "INT16", "UINT16", "INT32", "FLOAT", "FLOAT16"),
        "dali/operators/image/crop/crop_mirror_normalize.h: CMN_IN_TYPES (uint8_t, int16_t, uint16_t, int32_t, float, "
        "float16); CMN_OUT_TYPES (float, float16, uint8_t, int8_t)"),
    "Erase": _kernel(
        (*UNSIGNED, *SIGNED, "FLOAT"),
        "dali/operators/generic/erase/erase.cu: ERASE_SUPPORTED_TYPES (uint8_t, int8_t, uint16_t, int16_t, uint32_t, "
        "int32_t, uint64_t, int64_t, float): no float16 (the CPU backend, erase.cc, has it); channels first, last or "
        "none", layouts=("HWC", "CHW", "HW")),
    "Cast": CAST,
    "CastLike": CAST,
    "Flip": _kernel((*UNSIGNED, *SIGNED, "FLOAT", "FLOAT64"),
                    "dali/operators/generic/flip.cu: RunKernel, TYPE_SWITCH (DALI_NUMERIC_TYPES): uint8_t .. int64_t, "
                    "float, double; no float16"),
    "Pad": _kernel((*UNSIGNED, *SIGNED, "FLOAT", "FLOAT16", "BOOL"),
                   "dali/operators/generic/pad.h: PAD_SUPPORTED_TYPES (uint8_t .. int64_t, float, float16, bool)"),
    # nvidia.dali.auto_aug's operations (augment.py's policies run them on the uint8 images)
    "WarpAffine": WARP,
    "Rotate": WARP,
    "Brightness": BRIGHTNESS_CONTRAST,
    "BrightnessContrast": BRIGHTNESS_CONTRAST,  # augment._blend_uint8 (Color, Contrast): uint8 in, int16 out
    "ColorSpaceConversion": _kernel(
        ("UINT8",), "dali/operators/image/color/color_space_conversion.cu: RunImpl views input and output as "
                    "uint8_t; RGB -> GRAY is in dali/kernels/imgproc/color_manipulation/"
                    "color_space_conversion_kernel.cuh's RunColorSpaceConversionKernel (kRGB_TO_GRAY)"),
    "Equalize": _kernel(("UINT8",),
                        "dali/operators/image/color/equalize.cu: TYPE_SWITCH EQUALIZE_SUPPORTED_TYPES (uint8_t), "
                        "channels last", layouts=("HWC",)),
    "Filter": _kernel(("UINT8", "INT8", "UINT16", "INT16", "FLOAT16", "FLOAT"),
                      "dali/operators/image/convolution/filter.h: FILTER_INPUT_SUPPORTED_TYPES_GPU (uint8_t, int8_t, "
                      "uint16_t, int16_t, float16, float)"),
    "reductions__Min": REDUCE,
    "reductions__Max": REDUCE,
    "reductions__Sum": REDUCE,
    "reductions__Mean": REDUCE,
    "_ArithmeticGenericOp": _kernel(
        ("BOOL", *UNSIGNED, *SIGNED, "FLOAT", "FLOAT64"),
        "dali/operators/math/expressions/arithmetic_meta.h: ARITHMETIC_ALLOWED_TYPES (bool, uint8_t .. int64_t, float, "
        "double; 'TODO(klecki): float16')", inputs=None),
    # type-agnostic: they move whole elements by their size
    "_TensorSubscript": _kernel(None, "dali/operators/generic/slice/subscript.cu: SliceGPU over type_of_size<element "
                                      "size>"),
    "_conditional__Split": SPLIT_MERGE,
    "_conditional__Merge": SPLIT_MERGE,
    "Constant": _kernel(None, "dali/operators/generic/constant.cc: no input"),
}


def input_problem(schema: str, dtype: str | None, layout: str | None) -> str | None:
    """Why DALI 2.4's GPU backend of `schema` cannot run on an input of `dtype` and `layout` (None: not
    observed), or None when it can."""
    kernel = GPU_KERNELS.get(schema)
    if kernel is None:
        return (f"{schema} is not in tests/gpu_kernels.py: read its GPU type list in DALI 2.4's source "
                f"and add it")
    if dtype is None:
        needs = kernel.types is not None or kernel.layouts is not None
        return f"{schema}: its input was never observed, so its dtype is unknown" if needs else None
    if kernel.types is not None and dtype not in kernel.types:
        return f"{schema} gets {dtype}; DALI 2.4's GPU kernel takes {', '.join(sorted(kernel.types))} ({kernel.source})"
    if kernel.layouts is not None and layout not in kernel.layouts:
        return (f"{schema} gets layout {layout!r}; DALI 2.4's GPU kernel takes {', '.join(kernel.layouts)} "
                f"({kernel.source})")
    return None
