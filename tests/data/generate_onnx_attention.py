#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write onnx_attention.json: ONNX's Attention operator evaluated by ONNX's own reference implementation, one case
per attribute.

Each case builds one Attention node (opset 24; the window attributes need opset 25), runs it with
onnx.reference.ReferenceEvaluator on float64 inputs, and writes the inputs, the attributes and every output the
node produces (Y, present_key / present_value with a past, qk_matmul_output with a qk_matmul_output_mode).
tests/unit/onnx_attention_test.cpp maps each case onto one attend call and compares.

Inputs are multiples of 1/64 in [-2, 2): exact in fp16, bf16, float and double, so one file serves every storage
type. Where the reference evaluator departs from the operator's written spec it is not used: with a softcap, its
qk_matmul_output_mode 0 returns the capped scores (the spec: "the output of qk matmul"), so mode 0 is tested
without a softcap.

Run it with a python3 that has onnx and numpy (any virtual environment outside the repository):

    <venv>/bin/python tests/data/generate_onnx_attention.py

Fixed seed: a rerun with the same versions writes the same bytes. See README.md beside this script.
"""

import json
import math
import os

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from golden_json import dumps_golden

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = "tests/data/generate_onnx_attention.py"
MAX_FILE_BYTES = 300 * 1024
INPUT_NAMES = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
OUTPUT_NAMES = ["Y", "present_key", "present_value", "qk_matmul_output"]


def enc(a):
    """Array -> {"shape", "data"}: bools as 0/1, ints as ints, floats as shortest round-trip numbers, -inf as a
    string (JSON has no infinities)."""
    a = np.asarray(a)
    flat = a.reshape(-1).tolist()
    if a.dtype == np.bool_:
        data = [1 if x else 0 for x in flat]
    elif np.issubdtype(a.dtype, np.integer):
        data = [int(x) for x in flat]
    else:
        data = []
        for x in flat:
            if math.isnan(x) or x == math.inf:
                raise ValueError("refusing to write NaN or +inf into a golden file")
            data.append("-inf" if x == -math.inf else float(x))
    return {"shape": list(a.shape), "data": data}



def onnx_type(a):
    return {np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.bool_): TensorProto.BOOL,
            np.dtype(np.int64): TensorProto.INT64}[a.dtype]


def evaluate(inputs, attrs, opset):
    """Runs one Attention node; inputs maps INPUT_NAMES to arrays (missing: absent)."""
    last = max(i for i, n in enumerate(INPUT_NAMES) if n in inputs)
    node_inputs = [n if n in inputs else "" for n in INPUT_NAMES[: last + 1]]
    outputs = ["Y"]
    if "past_key" in inputs:
        outputs += ["present_key", "present_value"]
    if "qk_matmul_output_mode" in attrs:
        outputs = ["Y", "present_key", "present_value", "qk_matmul_output"]
    node = helper.make_node("Attention", node_inputs, outputs, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, onnx_type(a), list(a.shape)) for n, a in inputs.items()]
    graph_outputs = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in outputs]
    graph = helper.make_graph([node], "attention", graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    results = ReferenceEvaluator(model).run(None, inputs)
    kept = {"Y", "qk_matmul_output"} | ({"present_key", "present_value"} if "past_key" in inputs else set())
    return {n: r for n, r in zip(outputs, results) if n in kept}


class Cases:
    def __init__(self):
        self.rng = np.random.default_rng(20261207)
        self.cases = []

    def values(self, *shape):
        """Multiples of 1/64 in [-2, 2): exact in every storage type attend has."""
        return self.rng.integers(-128, 128, size=shape).astype(np.float64) / 64

    def allowed(self, *shape):
        """A Boolean mask with about a third forbidden and every row's first key allowed."""
        m = self.rng.random(shape) > 0.35
        m[..., 0] = True
        return m

    def additive(self, *shape):
        """An additive mask: small multiples of 1/8, about a quarter -inf, every row's first key finite."""
        m = self.rng.integers(-8, 8, size=shape).astype(np.float64) / 8
        m[self.rng.random(shape) < 0.25] = -np.inf
        m[..., 0] = 0.5
        return m

    def add(self, name, attrs=None, opset=24, batch=2, q_heads=2, kv_heads=2, query_len=3, key_len=5, dim=4,
            value_dim=3, packed=False, past=0, **extra):
        """One case: 4-D Q [batch, q_heads, query_len, dim], K / V [batch, kv_heads, key_len, ...] (3-D
        [batch, len, heads * dim] when packed), past_key / past_value of `past` positions, extra inputs."""
        attrs = dict(attrs or {})
        if packed:
            inputs = {"Q": self.values(batch, query_len, q_heads * dim), "K": self.values(batch, key_len, kv_heads * dim),
                      "V": self.values(batch, key_len, kv_heads * value_dim)}
            attrs.update(q_num_heads=q_heads, kv_num_heads=kv_heads)
        else:
            inputs = {"Q": self.values(batch, q_heads, query_len, dim), "K": self.values(batch, kv_heads, key_len, dim),
                      "V": self.values(batch, kv_heads, key_len, value_dim)}
        if past:
            inputs["past_key"] = self.values(batch, kv_heads, past, dim)
            inputs["past_value"] = self.values(batch, kv_heads, past, value_dim)
        inputs.update(extra)
        outputs = evaluate(inputs, attrs, opset)
        if any(np.isnan(o).any() for o in outputs.values()):
            raise AssertionError(f"{name}: the reference returned NaN")
        # float attributes as the node holds them: ONNX stores them as float32 (0.3 is 0.30000001192092896)
        held = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in attrs.items()}
        self.cases.append({"name": name, "opset": opset, "attributes": held,
                           "inputs": {k: enc(v) for k, v in inputs.items()},
                           "outputs": {k: enc(v) for k, v in outputs.items()}})


def main():
    c = Cases()
    L, S = 3, 5
    c.add("plain")
    # The reference scales q and k by sqrt(scale) taken in float32 (the attribute's type), so a scale whose root is
    # not a float (0.3) is applied as fl(sqrt(0.3f))^2, 1e-8 off; 0.25's root is exact.
    c.add("scale", {"scale": 0.25})
    c.add("gqa", q_heads=4, kv_heads=2)
    c.add("packed_3d_gqa", packed=True, q_heads=4, kv_heads=2)
    c.add("is_causal", {"is_causal": 1})
    c.add("is_causal_with_past", {"is_causal": 1}, past=2)
    c.add("past_without_causal", past=3, key_len=2)
    c.add("is_causal_nonpad_kv_seqlen", {"is_causal": 1}, nonpad_kv_seqlen=np.array([5, 4], dtype=np.int64))
    c.add("nonpad_kv_seqlen", nonpad_kv_seqlen=np.array([5, 2], dtype=np.int64))
    c.add("softcap", {"softcap": 1.5, "is_causal": 1}, q_heads=4, kv_heads=2)
    for rank, shape in ((1, (S,)), (2, (L, S)), (3, (2, L, S)), (4, (2, 1, L, S))):
        c.add(f"bool_mask_rank_{rank}", attn_mask=c.allowed(*shape))
        c.add(f"float_mask_rank_{rank}", attn_mask=c.additive(*shape))
    c.add("bool_mask_shorter_than_key_len", attn_mask=c.allowed(L, S - 2))
    c.add("float_mask_shorter_than_key_len", attn_mask=c.additive(2, 1, L, S - 1))
    c.add("bool_mask_with_is_causal", {"is_causal": 1}, attn_mask=c.allowed(2, 1, L, S))
    fully = c.allowed(L, S)
    fully[1, :] = False
    c.add("fully_masked_row", attn_mask=fully)
    c.add("qk_matmul_output_mode_0", {"qk_matmul_output_mode": 0}, attn_mask=c.additive(L, S))
    c.add("qk_matmul_output_mode_1", {"qk_matmul_output_mode": 1, "softcap": 1.25}, attn_mask=c.additive(L, S))
    c.add("qk_matmul_output_mode_2", {"qk_matmul_output_mode": 2, "softcap": 1.25, "is_causal": 1},
          attn_mask=c.additive(L, S))
    c.add("qk_matmul_output_mode_3", {"qk_matmul_output_mode": 3, "is_causal": 1}, attn_mask=c.allowed(L, S))
    c.add("softmax_precision_double", {"softmax_precision": TensorProto.DOUBLE, "is_causal": 1}, key_len=64,
          query_len=4)
    c.add("window_left_right", {"left_window_size": 1, "right_window_size": 1}, opset=25)
    c.add("window_left_unbounded_right", {"left_window_size": -1, "right_window_size": 0}, opset=25)
    c.add("window_with_causal_and_past", {"is_causal": 1, "left_window_size": 2}, opset=25, past=2)
    c.add("window_with_nonpad_kv_seqlen", {"is_causal": 1, "left_window_size": 1}, opset=25,
          nonpad_kv_seqlen=np.array([5, 3], dtype=np.int64))

    doc = {"generator": GENERATOR, "onnx": onnx.__version__, "numpy": np.__version__,
           "note": "ONNX Attention by onnx.reference.ReferenceEvaluator in float64; inputs are multiples of 1/64",
           "cases": c.cases}
    text = dumps_golden(doc) + "\n"
    if len(text) > MAX_FILE_BYTES:
        raise AssertionError(f"onnx_attention.json would be {len(text)} bytes, over {MAX_FILE_BYTES}")
    with open(os.path.join(HERE, "onnx_attention.json"), "w") as f:
        f.write(text)
    print(f"wrote {len(c.cases)} cases, {len(text)} bytes")


if __name__ == "__main__":
    main()
