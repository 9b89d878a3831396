"""Requantise a GGUF file's quantised tensors to another GGML type with gguf-py (the library
llama.cpp ships for reading and writing GGUF), so that llama.cpp runs, e.g., Q8_0 weights when
flashlane runs int8: int8 compared with int8, or F32 (the dequantised weights flashlane's float32
default runs). Float tensors (norms) are copied as they are.

    python benchmarks/gguf_requant.py IN.gguf OUT.gguf --type Q8_0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

_SKIP_KEYS = ("GGUF.", "general.architecture")   # written by GGUFWriter itself


def requantize(src: str | Path, dst: str | Path, qtype: str = "Q8_0") -> Path:
    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith(_SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]          # numpy order: rows last in GGUF's
        if t.tensor_type in float_types:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if target == gguf.GGMLQuantizationType.F32:        # unpacked: the file's own weights as float32
            writer.add_tensor(t.name, values)
            continue
        packed = gguf.quants.quantize(values, target)
        writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", default="Q8_0", choices=["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
    args = ap.parse_args()
    print(requantize(args.src, args.dst, args.type))


if __name__ == "__main__":
    main()
