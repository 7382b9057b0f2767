"""The tensor types the GPU card runs today, and the check at card build that refuses a model with any other.

The CPU side (numpy card, CPU pool) runs every type of stratad.model.quants; the GPU's dense kernels read every
type too (lane/kernels/decode.cuh), its expert kernels only these. A GPU lane checks the whole model before it
allocates anything, so a model it cannot run fails with one error naming the tensors, instead of starting
half-loaded.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T

from stratad.model import quants

GPU_EXPERT_TYPES = quants.EXPERT_TYPES  # lane/kernels/experts.cu: every type (tuned IQ3_S / Q4_K / Q8_0, generic rest)
GPU_DENSE_TYPES = quants.DENSE_TYPES  # lane/kernels/device.py's QNAME: decode.cuh's types


def unsupported_on_gpu(model) -> list[str]:
    """'name (TYPE)' of each tensor of the model that the GPU kernels cannot read."""
    bad = []
    for name, ti in model.tensors.items():
        ok = GPU_EXPERT_TYPES if "_exps." in name else GPU_DENSE_TYPES
        if ti.qtype not in ok:
            bad.append(f"{name} ({ti.qtype.name})")
    return bad


def check_gpu_types(model) -> None:
    bad = unsupported_on_gpu(model)
    if bad:
        more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
        raise ValueError(f"the GPU card cannot run {len(bad)} tensors of this model yet: {', '.join(bad[:6])}{more}; "
                         f"GPU expert types: {', '.join(t.name for t in GPU_EXPERT_TYPES)}; GPU dense types: "
                         f"{', '.join(t.name for t in GPU_DENSE_TYPES)} (the CPU cards run every type)")
