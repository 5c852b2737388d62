#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write nn.MultiheadAttention state dicts as .safetensors files, with PyTorch's outputs for them.

Run it with Debian's python3 (the one that has python3-torch), from anywhere:

    /usr/bin/python3 tests/data/generate_safetensors.py

It writes, next to this script:

    mha_packed.safetensors      E=8, 2 heads, packed in_proj_weight, biases; F64; no prefix
    mha_kdim_f32.safetensors    E=6, 3 heads, kdim=5, vdim=6 (q/k/v_proj_weight); F32; the module sits under
                                the prefix "encoder.attn." next to an unrelated tensor, with __metadata__
    mha_safetensors.json        per file: config, prefix, inputs, masks and PyTorch's out and averaged weights
    mha_packed_io.safetensors   the inputs and PyTorch's outputs of mha_packed.safetensors as F64 tensors (query,
                                key, value, out, weights_averaged), read by docs/porting_from_pytorch.md

The files are written by hand (struct + json), as safetensors.torch.save_file lays them out: an 8-byte
little-endian header length, the JSON header padded with spaces to a multiple of 8, then the tensors back to back,
row-major little-endian. The `safetensors` package is not needed.

Outputs are computed in float64 by nn.MultiheadAttention (eval mode, dropout 0) from the weights as stored: for
the F32 file, the float32-rounded weights, so a double module loaded from it reproduces the outputs to 1e-12.
Before writing, the script reads each file back with an independent reader (below), rebuilds the module from it
and checks that the outputs agree with generate_goldens.py's hand-written formula (mha_math) to 1e-12.
"""

import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from generate_goldens import mha_math  # noqa: E402  (the hand-written nn.MultiheadAttention formula)

TOL = 1e-12
GENERATOR = "tests/data/generate_safetensors.py"
DTYPES = {torch.float32: ("F32", "<f4"), torch.float64: ("F64", "<f8")}

torch.set_num_threads(1)


def encode(t):
    return {"shape": list(t.shape), "data": [float(x) for x in t.detach().reshape(-1).tolist()]}


def encode_bool(t):
    return {"shape": list(t.shape), "data": [int(x) for x in t.reshape(-1).tolist()]}


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, tensor) in data order."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        dtype, numpy_dtype = DTYPES[t.dtype]
        data = t.detach().contiguous().numpy().astype(numpy_dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """An independent reader: {name: float64 tensor}."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        fmt = {"F32": "f", "F64": "d"}[e["dtype"]]
        begin, end = e["data_offsets"]
        count = math.prod(e["shape"])
        values = struct.unpack("<%d%s" % (count, fmt), data[begin:end])
        out[name] = torch.tensor(values, dtype=torch.float64).reshape(e["shape"])
    return out


def case(file_name, seed, E, H, B, L, S, storage, prefix="", kdim=None, vdim=None, extra=None, metadata=None,
         io_file=None):
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, dropout=0.0, bias=True, batch_first=True, kdim=kdim, vdim=vdim,
                              dtype=torch.float64)
    m.eval()
    with torch.no_grad():
        m.in_proj_bias.normal_(0.0, 0.1)
        m.out_proj.bias.normal_(0.0, 0.1)
        for p in m.parameters():  # the weights as stored, so the outputs are those of the stored module
            p.copy_(p.to(storage).to(torch.float64))
    query = torch.randn(B, L, E)
    key = torch.randn(B, S, m.kdim)
    value = torch.randn(B, S, m.vdim)
    key_padding_mask = torch.zeros(B, S, dtype=torch.bool)
    key_padding_mask[-1, S - 2:] = True  # the last sequence has two padded keys
    attn_mask = torch.zeros(L, S, dtype=torch.bool)
    attn_mask[0, 1] = True
    attn_mask[L - 1, 0] = True
    with torch.no_grad():
        out, weights = m(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                         need_weights=True, average_attn_weights=True)

    state = [(prefix + name, t.to(storage)) for name, t in m.state_dict().items()]
    tensors = (extra or []) + state
    path = os.path.join(HERE, file_name)
    write_safetensors(path, tensors, metadata)

    # Read back independently, check every tensor and the hand-written formula against PyTorch's outputs.
    back = read_safetensors(path)
    params = {}
    for name, t in m.state_dict().items():
        assert torch.equal(back[prefix + name], t), name
        params[name] = back[prefix + name]
    cfg = {"embed_dim": E, "num_heads": H}
    formula_out, formula_w = mha_math(params, cfg, query, key, value, key_padding_mask, attn_mask[None, None])
    assert (formula_out - out).abs().max().item() <= TOL, file_name
    assert (formula_w.mean(dim=1) - weights).abs().max().item() <= TOL, file_name

    if io_file:
        io = [("query", query), ("key", key), ("value", value), ("out", out), ("weights_averaged", weights)]
        write_safetensors(os.path.join(HERE, io_file), io)
        back = read_safetensors(os.path.join(HERE, io_file))
        for name, t in io:
            assert torch.equal(back[name], t), name

    return {
        "file": file_name,
        "storage": DTYPES[storage][0],
        "prefix": prefix,
        "config": {"embed_dim": E, "num_heads": H, "kdim": m.kdim, "vdim": m.vdim, "bias": True},
        "parameter_names": [name for name, _ in m.state_dict().items()],
        "inputs": {"query": encode(query), "key": encode(key), "value": encode(value)},
        "masks": {"key_padding_mask": encode_bool(key_padding_mask), "attn_mask": encode_bool(attn_mask)},
        "outputs": {"out": encode(out), "weights_averaged": encode(weights)},
    }


def main():
    torch.manual_seed(0)
    norm = torch.randn(4, dtype=torch.float64).to(torch.float32)
    cases = [
        case("mha_packed.safetensors", 31, E=8, H=2, B=2, L=3, S=5, storage=torch.float64,
             io_file="mha_packed_io.safetensors"),
        case("mha_kdim_f32.safetensors", 32, E=6, H=3, B=2, L=4, S=4, storage=torch.float32,
             prefix="encoder.attn.", kdim=5, vdim=6, extra=[("encoder.norm.weight", norm)],
             metadata={"format": "pt"}),
    ]
    doc = {
        "generator": GENERATOR,
        "torch_version": torch.__version__,
        "conventions": {
            "masks": "key_padding_mask [B,S] and attn_mask [L,S]: 1 = blocked (nn.MultiheadAttention)",
            "outputs": "nn.MultiheadAttention(batch_first=True), eval, float64, average_attn_weights=True",
        },
        "cases": cases,
    }
    with open(os.path.join(HERE, "mha_safetensors.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
