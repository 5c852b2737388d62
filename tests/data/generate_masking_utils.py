#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write masking_utils.json: the masks transformers' own masking_utils builds, and attention under them.

Every Hugging Face model builds its masks with transformers.masking_utils. This script calls its mask functions
(causal_mask_function, sliding_window_causal_mask_function, chunked_causal_mask_function, blockwise_overlay,
or_masks, and sdpa_mask, which adds the padding of a 2-D attention_mask and the q / kv offsets) for random shapes,
paddings, offsets and decode shapes (query_len < key_len), and writes each mask with the float64 attention
output under it. tests/unit/masking_utils_golden_test.cpp builds the same mask from attend's named rules and
checks that materialize gives exactly these masks and scaled_dot_product_attention these outputs. Nothing here
reimplements a mask: the masks come from transformers, the outputs from float64 math checked against PyTorch's
own scaled_dot_product_attention.

Run it with a python3 that has torch and transformers (any virtual environment outside the repository):

    <venv>/bin/python tests/data/generate_masking_utils.py

Fixed seed, one thread: a rerun with the same versions writes the same bytes. See README.md beside this script.
"""

import json
import math
import os

import torch
import torch.nn.functional as F
import transformers
from transformers import masking_utils as mu

from golden_json import dumps_golden

DTYPE = torch.float64
TOL = 1e-12
HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = "tests/data/generate_masking_utils.py"
MAX_FILE_BYTES = 300 * 1024

torch.set_num_threads(1)
torch.set_default_dtype(DTYPE)


def enc(t, digits=None):
    """Tensor -> {"shape", "data"}: bools as 0/1, ints as ints, floats (optionally rounded) as numbers."""
    t = t.detach().cpu()
    flat = t.reshape(-1).tolist()
    if t.dtype == torch.bool:
        data = [1 if x else 0 for x in flat]
    elif t.dtype.is_floating_point:
        if any(math.isnan(x) or math.isinf(x) for x in flat):
            raise ValueError("refusing to write NaN or inf into a golden file")
        data = [round(x, digits) if digits is not None else float(x) for x in flat]
    else:
        data = [int(x) for x in flat]
    return {"shape": list(t.shape), "data": data}



def hf_mask(pattern, params, batch, query_len, key_len, q_offset, kv_offset, attention_mask):
    """The [batch, 1, query_len, key_len] bool mask transformers' sdpa_mask builds (True = may attend).

    attention_mask is HF's 2-D padding mask over absolute positions [0, kv_offset + key_len), or None.
    """
    if pattern == "causal":
        fn = mu.causal_mask_function
    elif pattern == "sliding_window":
        fn = mu.sliding_window_causal_mask_function(params["sliding_window"])
    elif pattern in ("chunked", "chunked_groups"):
        fn = mu.chunked_causal_mask_function(params["chunk_size"], params["hf_left_padding"])
    elif pattern == "bidirectional_groups":
        fn = mu.causal_mask_function
    else:
        raise ValueError(pattern)
    if pattern in ("bidirectional_groups", "chunked_groups"):
        # create_causal_mask / create_chunked_causal_mask: or_masks(pattern, blockwise_overlay(block_sequence_ids))
        fn = mu.or_masks(fn, mu.blockwise_overlay(params["hf_block_sequence_ids"]))
    mask = mu.sdpa_mask(batch_size=batch, q_length=query_len, kv_length=key_len, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask,
                        allow_is_causal_skip=False)
    assert mask is not None and tuple(mask.shape) == (batch, 1, query_len, key_len), mask
    return mask.to(torch.bool)


def left_padding_of(attention_mask):
    """create_chunked_causal_mask's count of left padding tokens per row, from HF's 2-D attention_mask."""
    return (attention_mask.cumsum(dim=-1) == torch.zeros_like(attention_mask)).sum(dim=-1)


def attention(q, k, v, allowed):
    """float64 attention of q [B,H,L,D] over k, v [B,Hkv,S,D] under allowed [B,L,S]: rows without a key give a zero
    output and lse -inf (attend's empty_rows::zero, PyTorch >= 2.5). Returns out, lse; checked against PyTorch."""
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~allowed.any(dim=-1)[:, None].expand_as(lse)
    weights = torch.where(empty[..., None], torch.zeros_like(scores), torch.exp(scores - lse[..., None]))
    out = weights @ ve
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    real = ~empty
    diff = (torch_out[real] - out[real]).abs().max().item() if real.any() else 0.0
    if not diff <= TOL * max(1.0, out.abs().max().item()):
        raise AssertionError(f"float64 attention differs from PyTorch's SDPA by {diff:.3e}")
    return out, lse


def random_attention_mask(g, batch, length, kind):
    """HF's 2-D attention_mask [batch, length] (1 = real token): left padding, right padding, or both kinds mixed."""
    m = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        pad = int(torch.randint(0, max(1, length // 2), (1,), generator=g))
        side = kind if kind != "mixed" else ("left" if b % 2 == 0 else "right")
        if pad:
            if side == "left":
                m[b, :pad] = 0
            else:
                m[b, length - pad:] = 0
    return m


def random_group_ids(g, batch, length):
    """block_sequence_ids [batch, length]: runs of text (-1) and of image groups numbered from 0."""
    ids = torch.full((batch, length), -1, dtype=torch.long)
    for b in range(batch):
        j, group = 0, 0
        while j < length:
            run = int(torch.randint(1, 5, (1,), generator=g))
            if float(torch.rand(1, generator=g)) < 0.5:
                ids[b, j:j + run] = group
                group += 1
            j += run
    return ids


PATTERNS = ["causal", "sliding_window", "chunked", "bidirectional_groups", "chunked_groups"]
# prefill: query_len == key_len, no offset; decode: the queries are the last positions (q_offset = key_len -
# query_len); rolled: the keys start past position 0 (kv_offset > 0, a rolled sliding or chunked cache);
# per_row: each batch row is its own sdpa_mask call with its own offsets and padding (per-row diagonals).
VARIANTS = ["prefill", "prefill_left_padded", "prefill_right_padded", "decode", "decode_left_padded", "rolled",
            "per_row"]


def make_case(g, pattern, variant):
    batch = 2
    heads, kv_heads = (4, 2) if variant in ("decode", "per_row") else (2, 2)
    head_dim = 4
    groups = pattern in ("bidirectional_groups", "chunked_groups")
    if variant == "rolled" and groups:
        return None  # group ids index key positions; a rolled cache's ids are its window's slice (see README.md)
    key_len = int(torch.randint(5, 13, (1,), generator=g))
    query_len = key_len if variant.startswith("prefill") else int(torch.randint(1, min(4, key_len) + 1, (1,),
                                                                               generator=g))
    rows = []  # per batch row: (q_offset, kv_offset, attention_mask row or None)
    pad_kind = {"prefill_left_padded": "left", "prefill_right_padded": "right", "decode_left_padded": "left", "rolled": "left",
                "per_row": "mixed"}.get(variant)
    for b in range(batch):
        kv_offset = int(torch.randint(1, 7, (1,), generator=g)) if variant in ("rolled", "per_row") and not groups \
            else 0
        if variant == "per_row":
            q_offset = kv_offset + int(torch.randint(0, key_len - query_len + 1, (1,), generator=g))
        else:
            q_offset = kv_offset + key_len - query_len
        rows.append([q_offset, kv_offset])
    if variant not in ("per_row",):
        rows = [rows[0]] * batch  # one sdpa_mask call: the offsets are the call's
    total = max(r[1] for r in rows) + key_len
    attention_mask = random_attention_mask(g, batch, total, pad_kind) if pad_kind else None
    params = {}
    if pattern == "sliding_window":
        params["sliding_window"] = int(torch.randint(1, 6, (1,), generator=g))
    if pattern in ("chunked", "chunked_groups"):
        params["chunk_size"] = int(torch.randint(1, 6, (1,), generator=g))
        params["hf_left_padding"] = (left_padding_of(attention_mask) if attention_mask is not None
                                     else torch.zeros(batch, dtype=torch.long))
    if groups:
        params["hf_block_sequence_ids"] = random_group_ids(g, batch, total)

    masks = []
    calls = [(0, batch)] if variant != "per_row" else [(b, b + 1) for b in range(batch)]
    for lo, hi in calls:
        q_offset, kv_offset = rows[lo]
        p = dict(params)
        if "hf_left_padding" in p:
            p["hf_left_padding"] = p["hf_left_padding"][lo:hi]
        if "hf_block_sequence_ids" in p:
            p["hf_block_sequence_ids"] = p["hf_block_sequence_ids"][lo:hi]
        am = attention_mask[lo:hi, :kv_offset + key_len] if attention_mask is not None else None
        masks.append(hf_mask(pattern, p, hi - lo, query_len, key_len, q_offset, kv_offset, am))
    allowed = torch.cat(masks, dim=0)[:, 0]  # [B, L, S]

    q = torch.randn(batch, heads, query_len, head_dim, generator=g).round(decimals=4)
    k = torch.randn(batch, kv_heads, key_len, head_dim, generator=g).round(decimals=4)
    v = torch.randn(batch, kv_heads, key_len, head_dim, generator=g).round(decimals=4)
    out, lse = attention(q, k, v, allowed)

    case = {
        "name": f"{pattern}_{variant}",
        "pattern": pattern,
        "hf": {"q_offset": [r[0] for r in rows], "kv_offset": [r[1] for r in rows]},
        "diagonal_offsets": [r[0] - r[1] for r in rows],
    }
    if attention_mask is not None:
        # attend's keys are positions [kv_offset, kv_offset + key_len) of each row
        case["key_padding"] = enc(torch.stack([attention_mask[b, rows[b][1]:rows[b][1] + key_len]
                                               for b in range(batch)]).to(torch.bool))
    if "sliding_window" in params:
        case["sliding_window"] = params["sliding_window"]
    if "chunk_size" in params:
        case["chunk_size"] = params["chunk_size"]
        case["hf"]["left_padding"] = params["hf_left_padding"].tolist()
        case["left_padding"] = [int(params["hf_left_padding"][b]) - rows[b][1] for b in range(batch)]
    if groups:
        case["group_ids"] = enc(params["hf_block_sequence_ids"][:, :key_len])
    case.update({"q": enc(q), "k": enc(k), "v": enc(v), "allowed": enc(allowed), "out": enc(out), "lse": enc(
        lse.masked_fill(torch.isinf(lse), 0.0))})
    case["empty_rows"] = enc(torch.isinf(lse))
    return case


def main():
    g = torch.Generator().manual_seed(68)
    cases = []
    for pattern in PATTERNS:
        for variant in VARIANTS:
            case = make_case(g, pattern, variant)
            if case is not None:
                cases.append(case)
    doc = {
        "generator": GENERATOR,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "conventions": {
            "allowed": "[batch, query_len, key_len] 0/1, 1 = may attend: transformers.masking_utils.sdpa_mask, the "
                       "same for every head",
            "positions": "query i of row b is position hf.q_offset[b] + i, key j position hf.kv_offset[b] + j; "
                         "diagonal_offsets[b] = q_offset - kv_offset",
            "key_padding": "HF's attention_mask over the row's keys (1 = real token); absent when the call had none",
            "left_padding": "the chunk start in attend's key axis: hf.left_padding - kv_offset",
            "group_ids": "block_sequence_ids over the keys, -1 = text",
            "out": "float64 attention under allowed, scale 1/sqrt(head_dim); rows without a key are zero",
            "lse": "natural-log logsumexp of the masked scores; 0 where empty_rows is 1 (lse -inf there)",
        },
        "cases": cases,
    }
    text = dumps_golden(doc) + "\n"
    json.loads(text)
    size = len(text.encode())
    if size > MAX_FILE_BYTES:
        raise AssertionError(f"masking_utils.json: {size} bytes exceeds {MAX_FILE_BYTES}")
    path = os.path.join(HERE, "masking_utils.json")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path} ({size} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
