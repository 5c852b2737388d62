#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Write attend's golden reference files with PyTorch, independently of attend's own code.

Run it with a python3 that has PyTorch (Debian's python3-torch 1.13 wrote the first four files, PyTorch 2.x
score_features.json), from anywhere:

    python3 tests/data/generate_goldens.py

It writes, next to this script:

    sdpa.json           scaled dot-product attention: out, weights, lse for every mask convention
    sdpa_backward.json  dq, dk, dv of SDPA (bottom-right causal, GQA) by autograd
    mha.json            nn.MultiheadAttention forward and backward, parameters by their PyTorch names
    positions.json      sinusoidal table, T5 relative_position_bucket, ALiBi slopes, rotary embedding
    score_features.json attention sinks (with soft-capping): out, weights, lse, dq, dk, dv, d_sinks by autograd
    storage16.json      fp16 / bf16 inputs as PyTorch rounds them, float64 attention on them, PyTorch's own 16-bit
                        CPU attention

Name files on the command line to write only those (e.g. `generate_goldens.py score_features.json`).

Everything is computed in float64 from fixed seeds. Each value is computed by explicit math and
cross-checked inside this script against a second route (PyTorch's own attention functions,
autograd vs. closed-form gradients, complex-number rotary, ...) to 1e-12; the script fails loudly
instead of writing a file when two routes disagree.

Tensor encoding: {"shape": [...], "data": [flat row-major values]}; booleans as 0/1;
-inf as the string "-inf" (JSON has no infinities). See README.md beside this script.
"""

import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPE = torch.float64
TOL = 1e-12
HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = "tests/data/generate_goldens.py"
MAX_FILE_BYTES = 300 * 1024

torch.set_num_threads(1)
torch.set_default_dtype(DTYPE)


# ----------------------------------------------------------------------------------------------
# encoding and checking helpers
# ----------------------------------------------------------------------------------------------

def enc(t):
    """Tensor -> {"shape", "data"} with bools as 0/1 and infinities as strings."""
    t = t.detach().cpu()
    flat = t.reshape(-1).tolist()
    if t.dtype == torch.bool:
        data = [1 if x else 0 for x in flat]
    elif t.dtype.is_floating_point:
        data = []
        for x in flat:
            if math.isnan(x):
                raise ValueError("refusing to write NaN into a golden file")
            if x == -math.inf:
                data.append("-inf")
            elif x == math.inf:
                data.append("inf")
            else:
                data.append(float(x))
    else:
        data = [int(x) for x in flat]
    return {"shape": list(t.shape), "data": data}


def check(what, got, want, tol=TOL):
    """Assert two tensors agree to tol (relative to the larger magnitude, at least 1)."""
    got = got.detach().to(DTYPE)
    want = want.detach().to(DTYPE)
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if torch.isnan(got).any() or torch.isnan(want).any():
        raise AssertionError(f"{what}: NaN present")
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        raise AssertionError(f"{what}: infinities differ")
    fin = ~inf_g
    if fin.any():
        diff = (got[fin] - want[fin]).abs().max().item()
        mag = max(1.0, want[fin].abs().max().item())
        if diff > tol * mag:
            raise AssertionError(f"{what}: max abs diff {diff:.3e} > {tol:.1e} * {mag:.3g}")


def check_exact(what, got, want):
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: differs at {bad}")


def dumps_golden(obj, indent=0):
    """Pretty JSON with every list of scalars on one line (keeps files small and diffable)."""
    pad = " " * indent
    inner = " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {dumps_golden(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(not isinstance(x, (dict, list)) for x in obj):
            return json.dumps(obj, separators=(",", ":"), allow_nan=False)
        items = [inner + dumps_golden(x, indent + 1) for x in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, allow_nan=False)


def write_golden(filename, body):
    doc = {"generator": GENERATOR, "torch_version": torch.__version__}
    doc.update(body)
    text = dumps_golden(doc) + "\n"
    json.loads(text)  # round-trip sanity
    size = len(text.encode())
    if size > MAX_FILE_BYTES:
        raise AssertionError(f"{filename}: {size} bytes exceeds {MAX_FILE_BYTES}")
    path = os.path.join(HERE, filename)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path} ({size} bytes)")


# ----------------------------------------------------------------------------------------------
# scaled dot-product attention: the contract, written out by hand
# ----------------------------------------------------------------------------------------------

def expand_kv(x, heads):
    """[B, Hkv, S, D] -> [B, heads, S, D]: query head h reads kv head h // (heads // Hkv)."""
    kv_heads = x.shape[1]
    assert heads % kv_heads == 0
    group = heads // kv_heads
    index = torch.tensor([h // group for h in range(heads)])
    return x.index_select(1, index)


def causal_allowed(L, S, alignment):
    i = torch.arange(L).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    if alignment == "top_left":
        return j <= i
    if alignment == "bottom_right":
        return j <= i + (S - L)
    raise ValueError(alignment)


def mask_bias(mask, L, S):
    """The additive form (0 / -inf / finite bias) of a mask, broadcastable to [..., L, S]."""
    kind = mask["kind"]
    ninf = torch.tensor(-math.inf)
    zero = torch.tensor(0.0)
    if kind == "none":
        return torch.zeros(L, S)
    if kind == "sdpa_bool":  # True = may attend
        return torch.where(mask["tensor"], zero, ninf)
    if kind == "mha_bool":  # True = blocked
        return torch.where(mask["tensor"], ninf, zero)
    if kind == "additive":
        return mask["tensor"].clone()
    if kind == "causal_top_left":
        return torch.where(causal_allowed(L, S, "top_left"), zero, ninf)
    if kind == "causal_bottom_right":
        return torch.where(causal_allowed(L, S, "bottom_right"), zero, ninf)
    raise ValueError(kind)


def as_rank4(q, k, v):
    """Rank-3 [B, L, D] inputs mean one head."""
    if q.dim() == 3:
        return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    return q, k, v


def sdpa_math(q, k, v, mask, scale):
    """Explicit float64 math. Returns out, weights, lse in the input's rank."""
    rank = q.dim()
    q4, k4, v4 = as_rank4(q, k, v)
    B, H, L, D = q4.shape
    S = k4.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    kk = expand_kv(k4, H)
    vv = expand_kv(v4, H)
    scores = torch.matmul(q4, kk.transpose(-1, -2)) * scale + mask_bias(mask, L, S)
    row_max = scores.amax(dim=-1, keepdim=True)
    if torch.isinf(row_max).any():
        raise AssertionError("a query row has no allowed key (empty rows are tested elsewhere)")
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    weights = e / denom
    out = torch.matmul(weights, vv)
    lse = (row_max + torch.log(denom)).squeeze(-1)
    # cross-check: library softmax / logsumexp on the same masked scores
    check("softmax", weights, torch.softmax(scores, dim=-1))
    check("logsumexp", lse, torch.logsumexp(scores, dim=-1))
    check("weights == exp(scores - lse)", weights, torch.exp(scores - lse.unsqueeze(-1)))
    if rank == 3:
        return out.squeeze(1), weights.squeeze(1), lse.squeeze(1)
    return out, weights, lse


def repeat_kv(x, heads):
    """Second, independent GQA expansion for the cross-checks: each kv head repeated heads/Hkv times."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def tril_allowed(L, S, diagonal):
    """Second, independent causal rule for the cross-checks: torch.tril's diagonal offset
    (top-left = 0, bottom-right = S - L)."""
    return torch.ones(L, S, dtype=torch.bool).tril(diagonal)


def torch_sdpa(q, k, v, attn_mask, is_causal):
    """PyTorch's own SDPA: (out, weights or None). 1.13: F._scaled_dot_product_attention."""
    if hasattr(F, "_scaled_dot_product_attention"):  # PyTorch 1.13 (private, returns weights)
        return F._scaled_dot_product_attention(q, k, v, attn_mask, 0.0, True, is_causal)
    if hasattr(F, "scaled_dot_product_attention"):  # PyTorch >= 2.0 (public, out only)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal), None
    return None


def cross_check_torch_sdpa(name, q, k, v, mask, scale, out, weights):
    """Route 2: PyTorch's SDPA (SDPA convention: bool True = may attend; float = added)."""
    q4, k4, v4 = as_rank4(q, k, v)
    D = q4.shape[-1]
    H = q4.shape[1]
    L, S = q4.shape[2], k4.shape[2]
    if scale is not None:  # 1.13 has no scale argument: fold scale * sqrt(D) into q
        q4 = q4 * (scale * math.sqrt(D))
    kk, vv = repeat_kv(k4, H), repeat_kv(v4, H)
    kind = mask["kind"]
    attn_mask, is_causal = None, False
    if kind == "sdpa_bool":
        attn_mask = mask["tensor"]
    elif kind == "mha_bool":
        attn_mask = ~mask["tensor"]
    elif kind == "additive":
        attn_mask = mask["tensor"]
    elif kind == "causal_top_left":
        is_causal = True  # PyTorch's is_causal is top-left aligned
    elif kind == "causal_bottom_right":
        attn_mask = tril_allowed(L, S, S - L)
    res = torch_sdpa(q4, kk, vv, attn_mask, is_causal)
    if res is None:
        raise AssertionError("this PyTorch has no scaled_dot_product_attention")
    o, w = res
    if q.dim() == 3:
        o = o.squeeze(1)
        w = w.squeeze(1) if w is not None else None
    check(f"{name}: torch SDPA out", o, out)
    if w is not None:
        check(f"{name}: torch SDPA weights", w, weights)


def cross_check_torch_mha(name, q, k, v, mask, scale, out, weights):
    """Route 3: F.multi_head_attention_forward with identity projections (MHA convention:
    bool True = blocked, float = added, key_padding_mask [B, S] True = ignore)."""
    q4, k4, v4 = as_rank4(q, k, v)
    B, H, L, D = q4.shape
    S, Dv = k4.shape[2], v4.shape[3]
    if Dv != D:
        return False  # MHA projects values to embed_dim: needs Dv == D
    if scale is not None:  # MHA always divides by sqrt(head_dim)
        q4 = q4 * (scale * math.sqrt(D))
    kk, vv = repeat_kv(k4, H), repeat_kv(v4, H)
    E = H * D
    to_lbe = lambda x: x.permute(2, 0, 1, 3).reshape(x.shape[2], B, E)  # noqa: E731
    kind = mask["kind"]
    attn_mask, key_padding_mask = None, None

    def per_head(m):  # broadcastable [.., L, S] -> [L, S] or [B*H, L, S] (MHA's 3-D layout)
        if m.dim() == 2:
            return m
        return m.expand(B, H, L, S).reshape(B * H, L, S)

    if kind in ("sdpa_bool", "mha_bool"):
        blocked = ~mask["tensor"] if kind == "sdpa_bool" else mask["tensor"]
        if blocked.dim() == 4 and blocked.shape[1] == 1 and blocked.shape[2] == 1 and blocked.shape[0] == B:
            key_padding_mask = blocked.reshape(B, S)  # [B,1,1,S] is key padding
        else:
            attn_mask = per_head(blocked)
    elif kind == "additive":
        attn_mask = per_head(mask["tensor"])
    elif kind == "causal_top_left":
        attn_mask = ~tril_allowed(L, S, 0)
    elif kind == "causal_bottom_right":
        attn_mask = ~tril_allowed(L, S, S - L)
    eye = torch.eye(E)
    o, w = F.multi_head_attention_forward(
        to_lbe(q4), to_lbe(kk), to_lbe(vv), E, H,
        None, None, None, None, False, 0.0, eye, None,
        training=False, key_padding_mask=key_padding_mask, need_weights=True, attn_mask=attn_mask,
        use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye, v_proj_weight=eye,
        average_attn_weights=False)
    o = o.reshape(L, B, H, D).permute(1, 2, 0, 3)
    if q.dim() == 3:
        o, w = o.squeeze(1), w.squeeze(1)
    check(f"{name}: F.multi_head_attention_forward out", o, out)
    check(f"{name}: F.multi_head_attention_forward weights", w, weights)
    return True


def allowed_bool(shape, p_block, ensure_rows=True):
    """Random allowed-mask (True = may attend) with at least one allowed key per row."""
    m = torch.rand(shape) >= p_block
    if ensure_rows:
        S = shape[-1]
        flat = m.reshape(-1, S)
        pick = torch.randint(0, S, (flat.shape[0],))
        flat[torch.arange(flat.shape[0]), pick] = True
        m = flat.reshape(shape)
    return m


def key_padding_allowed(lengths, S):
    """[B, 1, 1, S] allowed mask: key j of batch b allowed iff j < lengths[b]."""
    j = torch.arange(S)
    return torch.stack([j < n for n in lengths]).reshape(len(lengths), 1, 1, S)


def additive_tensor(shape):
    """Finite biases from a fixed set plus -inf entries, at least one finite entry per row."""
    values = torch.tensor([0.0, -2.5, 0.7, 1.25, -0.5])
    t = values[torch.randint(0, len(values), shape)]
    blocked = ~allowed_bool(shape, 0.3)
    return t.masked_fill(blocked, -math.inf)


def build_sdpa():
    torch.manual_seed(20240601)
    cases = []

    def add(name, B, H, Hkv, L, S, D, Dv, mask, scale=None, rank=4):
        if rank == 3:
            assert H == 1 and Hkv == 1
            q, k, v = torch.randn(B, L, D), torch.randn(B, S, D), torch.randn(B, S, Dv)
        else:
            q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
        out, weights, lse = sdpa_math(q, k, v, mask, scale)
        cross_check_torch_sdpa(name, q, k, v, mask, scale, out, weights)
        mha_checked = cross_check_torch_mha(name, q, k, v, mask, scale, out, weights)
        case = {
            "name": name,
            "q": enc(q), "k": enc(k), "v": enc(v),
            "mask": {"kind": mask["kind"]},
            "scale": scale,
            "out": enc(out), "weights": enc(weights), "lse": enc(lse),
        }
        if "tensor" in mask:
            case["mask"]["tensor"] = enc(mask["tensor"])
        cases.append(case)
        print(f"  sdpa {name}: ok (torch SDPA{', F.multi_head_attention_forward' if mha_checked else ''})")

    # no mask
    add("none_square", 2, 2, 2, 4, 4, 8, 8, {"kind": "none"})
    add("none_rect_L3_S6_D5_Dv7", 1, 3, 3, 3, 6, 5, 7, {"kind": "none"})
    add("none_custom_scale", 2, 2, 2, 5, 4, 4, 6, {"kind": "none"}, scale=0.3)
    add("rank3_none", 2, 1, 1, 5, 7, 6, 3, {"kind": "none"}, rank=3)
    add("rank3_sdpa_bool_2d", 2, 1, 1, 4, 6, 5, 5,
        {"kind": "sdpa_bool", "tensor": allowed_bool((4, 6), 0.4)}, rank=3)
    # Boolean masks, SDPA convention (True = may attend)
    add("sdpa_bool_2d", 2, 2, 2, 4, 6, 4, 4, {"kind": "sdpa_bool", "tensor": allowed_bool((4, 6), 0.4)})
    add("sdpa_bool_key_padding_B11S", 2, 3, 3, 4, 5, 4, 4,
        {"kind": "sdpa_bool", "tensor": key_padding_allowed([5, 2], 5)})
    add("sdpa_bool_per_head_1HLS", 2, 2, 2, 3, 5, 4, 6,
        {"kind": "sdpa_bool", "tensor": allowed_bool((1, 2, 3, 5), 0.5)})
    # Boolean masks, nn.MultiheadAttention convention (True = blocked)
    add("mha_bool_2d", 2, 2, 2, 5, 4, 4, 4, {"kind": "mha_bool", "tensor": ~allowed_bool((5, 4), 0.4)})
    add("mha_bool_B1LS", 2, 2, 2, 4, 6, 4, 4, {"kind": "mha_bool", "tensor": ~allowed_bool((2, 1, 4, 6), 0.4)})
    add("mha_bool_key_padding_B11S", 2, 2, 2, 3, 6, 4, 4,
        {"kind": "mha_bool", "tensor": ~key_padding_allowed([4, 6], 6)})
    # additive masks (added to the scaled scores; -inf forbids)
    add("additive_2d", 2, 2, 2, 4, 5, 4, 4, {"kind": "additive", "tensor": additive_tensor((4, 5))})
    add("additive_1HLS_custom_scale", 1, 3, 3, 4, 6, 4, 4,
        {"kind": "additive", "tensor": additive_tensor((1, 3, 4, 6))}, scale=0.45)
    # causal
    add("causal_top_left_square", 2, 2, 2, 5, 5, 4, 4, {"kind": "causal_top_left"})
    add("causal_top_left_L3_S6", 2, 2, 2, 3, 6, 4, 5, {"kind": "causal_top_left"})
    add("causal_top_left_L6_S4", 1, 2, 2, 6, 4, 4, 4, {"kind": "causal_top_left"})
    add("causal_bottom_right_L3_S6", 2, 2, 2, 3, 6, 4, 5, {"kind": "causal_bottom_right"})
    add("causal_bottom_right_L1_S5_decode", 2, 2, 2, 1, 5, 4, 4, {"kind": "causal_bottom_right"})
    # grouped-query / multi-query
    add("gqa_H4_Hkv2_none", 2, 4, 2, 3, 5, 4, 6, {"kind": "none"})
    add("gqa_H4_Hkv2_key_padding", 2, 4, 2, 4, 5, 4, 4,
        {"kind": "sdpa_bool", "tensor": key_padding_allowed([3, 5], 5)})
    add("mqa_H4_Hkv1_causal_bottom_right", 1, 4, 1, 3, 5, 4, 3, {"kind": "causal_bottom_right"})
    add("gqa_H4_Hkv1_additive_B1LS", 2, 4, 1, 3, 4, 4, 4,
        {"kind": "additive", "tensor": additive_tensor((2, 1, 3, 4))})

    write_golden("sdpa.json", {
        "conventions": {
            "layout": "q [B,H,L,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv]; rank 3 [B,L,D] = one head",
            "gqa": "query head h reads kv head h // (H / Hkv)",
            "scale": "null = 1/sqrt(D)",
            "mask.sdpa_bool": "1 = may attend (PyTorch SDPA)",
            "mask.mha_bool": "1 = blocked (nn.MultiheadAttention)",
            "mask.additive": "added to the scaled scores; -inf forbids",
            "mask.causal_top_left": "key j allowed iff j <= i",
            "mask.causal_bottom_right": "key j allowed iff j <= i + S - L",
            "mask.broadcast": "mask tensors broadcast (right-aligned) to [B,H,L,S] ([B,L,S] for rank 3)",
            "lse": "natural-log logsumexp over keys of the scaled, masked scores",
        },
        "cases": cases,
    })


# ----------------------------------------------------------------------------------------------
# SDPA backward
# ----------------------------------------------------------------------------------------------

def sdpa_backward_closed_form(q, k, v, mask, scale, d_out):
    """dq, dk, dv from the textbook formulas (no autograd)."""
    B, H, L, D = q.shape
    S = k.shape[2]
    Hkv = k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    kk, vv = expand_kv(k, H), expand_kv(v, H)
    s = q @ kk.transpose(-1, -2) * scale + mask_bias(mask, L, S)
    p = torch.softmax(s, dim=-1)
    o = p @ vv
    dv_full = p.transpose(-1, -2) @ d_out
    dp = d_out @ vv.transpose(-1, -2)
    delta = (d_out * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * ds @ kk
    dk_full = scale * ds.transpose(-1, -2) @ q
    group = H // Hkv
    dk = dk_full.reshape(B, Hkv, group, S, D).sum(2)
    dv = dv_full.reshape(B, Hkv, group, S, v.shape[-1]).sum(2)
    return dq, dk, dv


def random_qkv(B, H, Hkv, L, S, D, Dv):
    """q [B,H,L,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv] from the standard normal, requiring gradients."""
    return (torch.randn(B, H, L, D, requires_grad=True), torch.randn(B, Hkv, S, D, requires_grad=True),
            torch.randn(B, Hkv, S, Dv, requires_grad=True))


def build_sdpa_backward():
    torch.manual_seed(20240602)
    cases = []

    def add(name, B, H, Hkv, L, S, D, Dv, mask, scale=None):
        q, k, v = random_qkv(B, H, Hkv, L, S, D, Dv)
        d_out = torch.randn(B, H, L, Dv)
        out, weights, lse = sdpa_math(q, k, v, mask, scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
        # route 2: closed-form gradients
        cdq, cdk, cdv = sdpa_backward_closed_form(q.detach(), k.detach(), v.detach(), mask, scale, d_out)
        check(f"{name}: dq closed form", cdq, dq)
        check(f"{name}: dk closed form", cdk, dk)
        check(f"{name}: dv closed form", cdv, dv)
        # route 3: autograd through PyTorch's own SDPA with an SDPA-convention bool mask
        L_, S_ = q.shape[2], k.shape[2]
        qs = q if scale is None else q * (scale * math.sqrt(D))
        res = torch_sdpa(qs, repeat_kv(k, H), repeat_kv(v, H),
                         tril_allowed(L_, S_, S_ - L_) if mask["kind"] == "causal_bottom_right"
                         else None, False)
        o2 = res[0]
        check(f"{name}: torch SDPA out", o2, out)
        g2 = torch.autograd.grad(o2, (q, k, v), d_out)
        for label, a, b in zip(("dq", "dk", "dv"), g2, (dq, dk, dv)):
            check(f"{name}: torch SDPA {label}", a, b)
        # route 4: finite differences on the explicit math
        assert torch.autograd.gradcheck(
            lambda a, b, c: sdpa_math(a, b, c, mask, scale)[0],
            (q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_(),
             v.detach().clone().requires_grad_()), eps=1e-6, atol=1e-8)
        cases.append({
            "name": name,
            "q": enc(q), "k": enc(k), "v": enc(v),
            "mask": {"kind": mask["kind"]},
            "scale": scale,
            "d_out": enc(d_out),
            "out": enc(out), "weights": enc(weights), "lse": enc(lse),
            "dq": enc(dq), "dk": enc(dk), "dv": enc(dv),
        })
        print(f"  sdpa_backward {name}: ok (closed form, torch SDPA autograd, gradcheck)")

    add("causal_bottom_right_L3_S5", 2, 2, 2, 3, 5, 4, 3, {"kind": "causal_bottom_right"})
    add("gqa_H4_Hkv2_causal_bottom_right_L3_S5", 2, 4, 2, 3, 5, 4, 3, {"kind": "causal_bottom_right"})

    write_golden("sdpa_backward.json", {
        "conventions": {
            "layout": "q [B,H,L,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv], d_out/out [B,H,L,Dv], lse [B,H,L]",
            "gqa": "query head h reads kv head h // (H / Hkv); dk, dv are summed over the group",
            "scale": "null = 1/sqrt(D)",
            "mask.causal_bottom_right": "key j allowed iff j <= i + S - L",
        },
        "cases": cases,
    })


# ----------------------------------------------------------------------------------------------
# score features: attention sinks (with soft-capping)
# ----------------------------------------------------------------------------------------------

def sinks_math(q, k, v, sinks, mask, scale, softcap):
    """Attention with a sink logit per query head joining the softmax denominator (gpt-oss): the scores get one
    more column holding the sink, the softmax runs over it, and the column is dropped before multiplying by v.
    Returns out, weights (without the sink column), lse (with it)."""
    B, H, L, D = q.shape
    S = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    scores = torch.matmul(q, expand_kv(k, H).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + mask_bias(mask, L, S)
    column = sinks.reshape(1, H, 1, 1).expand(B, H, L, 1)
    full = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    weights = torch.softmax(full, dim=-1)[..., :S]
    out = torch.matmul(weights, expand_kv(v, H))
    return out, weights, lse


def build_score_features():
    torch.manual_seed(20261201)
    cases = []

    def add(name, B, H, Hkv, L, S, D, Dv, mask, softcap=None):
        q, k, v = random_qkv(B, H, Hkv, L, S, D, Dv)
        sinks = (torch.randn(H) * 1.5).requires_grad_()
        d_out = torch.randn(B, H, L, Dv)
        out, weights, lse = sinks_math(q, k, v, sinks, mask, None, softcap)
        dq, dk, dv, d_sinks = torch.autograd.grad(out, (q, k, v, sinks), d_out)
        # route 2: PyTorch's own SDPA over one more key (zero key, zero value) whose float mask entry is the sink
        # (without softcap, which SDPA does not have)
        if softcap is None:
            zk = torch.cat([repeat_kv(k, H), torch.zeros(B, H, 1, D)], dim=2)
            zv = torch.cat([repeat_kv(v, H), torch.zeros(B, H, 1, Dv)], dim=2)
            bias = torch.cat([mask_bias(mask, L, S).expand(B, H, L, S),
                              sinks.reshape(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
            o2 = F.scaled_dot_product_attention(q, zk, zv, attn_mask=bias)
            check(f"{name}: torch SDPA with the sink as a key", o2, out)
            g2 = torch.autograd.grad(o2, (q, k, v, sinks), d_out)
            for label, a, b in zip(("dq", "dk", "dv", "d_sinks"), g2, (dq, dk, dv, d_sinks)):
                check(f"{name}: torch SDPA {label}", a, b)
        # route 3: the closed form of the sinks' gradient, -sum over rows of p_sink * rowsum(d_out * out)
        p_sink = torch.exp(sinks.reshape(1, H, 1) - lse)
        check(f"{name}: d_sinks closed form", -(p_sink * (d_out * out).sum(-1)).sum((0, 2)), d_sinks)
        # route 4: finite differences
        assert torch.autograd.gradcheck(
            lambda a, b, c, z: sinks_math(a, b, c, z, mask, None, softcap)[0],
            tuple(x.detach().clone().requires_grad_() for x in (q, k, v, sinks)), eps=1e-6, atol=1e-8)
        cases.append({
            "name": name, "mask": {"kind": mask["kind"]}, "softcap": softcap,
            "q": enc(q), "k": enc(k), "v": enc(v), "sinks": enc(sinks), "d_out": enc(d_out),
            "out": enc(out), "weights": enc(weights), "lse": enc(lse),
            "dq": enc(dq), "dk": enc(dk), "dv": enc(dv), "d_sinks": enc(d_sinks),
        })
        print(f"  score_features {name}: ok (torch SDPA with a sink key, closed form, gradcheck)")

    add("sinks_gqa_H4_Hkv2_causal_bottom_right_L3_S5", 2, 4, 2, 3, 5, 4, 3, {"kind": "causal_bottom_right"})
    add("sinks_softcap_1.5_L4_S6", 1, 2, 2, 4, 6, 4, 4, {"kind": "none"}, softcap=1.5)

    # FlexAttention (forward only on CPU): a score_mod and a mask_mod, checked against the explicit math, whose
    # autograd gives the gradients.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def wavy(score, b, h, i, j):
        return score + 0.3 * torch.sin(score) * (h + 1) / (1 + (i - j).abs())

    def add_flex(name, B, H, Hkv, L, S, D, allowed, score_mod=None):
        q, k, v = random_qkv(B, H, Hkv, L, S, D, D)
        d_out = torch.randn(B, H, L, D)
        i = torch.arange(L).reshape(L, 1)
        j = torch.arange(S).reshape(1, S)
        allow = allowed(i, j)

        def explicit(q, k, v):
            scores = torch.matmul(q, expand_kv(k, H).transpose(-1, -2)) / math.sqrt(D)
            if score_mod is not None:
                h = torch.arange(H).reshape(1, H, 1, 1)
                scores = score_mod(scores, 0, h, i, j)
            scores = scores.masked_fill(~allow, -math.inf)
            return torch.matmul(torch.softmax(scores, -1), expand_kv(v, H)), torch.logsumexp(scores, -1)

        out, lse = explicit(q, k, v)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
        block = create_block_mask(lambda b, h, qi, kv: allowed(qi, kv), B, H, L, S, device="cpu")
        fo, fl = flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=block,
                                enable_gqa=H != Hkv, return_lse=True)
        check(f"{name}: FlexAttention out", fo, out)
        check(f"{name}: FlexAttention lse", fl, lse)
        assert torch.autograd.gradcheck(lambda a, b, c: explicit(a, b, c)[0],
                                        tuple(x.detach().clone().requires_grad_() for x in (q, k, v)),
                                        eps=1e-6, atol=1e-8)
        cases.append({
            "name": name, "mask": {"kind": name}, "softcap": None,
            "q": enc(q), "k": enc(k), "v": enc(v), "d_out": enc(d_out),
            "out": enc(out), "lse": enc(lse), "dq": enc(dq), "dk": enc(dk), "dv": enc(dv),
        })
        print(f"  score_features {name}: ok (FlexAttention forward, autograd, gradcheck)")

    add_flex("flex_score_mod_wavy_causal_bottom_right", 2, 4, 2, 5, 7, 4,
             lambda i, j: j <= i + 2, score_mod=wavy)
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    add_flex("flex_mask_mod_documents_causal", 1, 2, 2, 10, 10, 4,
             lambda i, j: (documents[i] == documents[j]) & (j <= i))

    write_golden("score_features.json", {
        "conventions": {
            "layout": "q [B,H,L,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv], sinks [H], d_out/out [B,H,L,Dv], lse [B,H,L]",
            "sinks": "one logit per query head in every row's softmax denominator, no value; lse includes it",
            "flex_score_mod_wavy_causal_bottom_right": "score + 0.3 sin(score) (h + 1) / (1 + |i - j|), keys j <= i + 2",
            "flex_mask_mod_documents_causal": "documents [0,0,0,1,1,1,1,2,2,2], j <= i within a document",
            "softcap": "null = none; else scores = softcap * tanh(scale q.k / softcap) before the mask",
            "scale": "1/sqrt(D)",
            "mask.causal_bottom_right": "key j allowed iff j <= i + S - L",
        },
        "cases": cases,
    })


# ----------------------------------------------------------------------------------------------
# nn.MultiheadAttention
# ----------------------------------------------------------------------------------------------

def mha_math(params, cfg, query, key, value, key_padding_mask, attn_mask):
    """nn.MultiheadAttention(batch_first=True) written out; returns out, per-head weights."""
    E, H = cfg["embed_dim"], cfg["num_heads"]
    hd = E // H
    if "in_proj_weight" in params:
        Wq, Wk, Wv = params["in_proj_weight"].chunk(3)
    else:
        Wq, Wk, Wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    if "in_proj_bias" in params:
        bq, bk, bv = params["in_proj_bias"].chunk(3)
    else:
        bq = bk = bv = None
    B, L, _ = query.shape
    S = key.shape[1]

    def proj(x, W, b, n):
        y = x @ W.t()
        if b is not None:
            y = y + b
        return y.reshape(B, n, H, hd).transpose(1, 2)  # [B, H, n, hd]

    Q, K, V = proj(query, Wq, bq, L), proj(key, Wk, bk, S), proj(value, Wv, bv, S)
    blocked = torch.zeros(B, 1, L, S, dtype=torch.bool)
    if attn_mask is not None:
        blocked = blocked | attn_mask
    if key_padding_mask is not None:
        blocked = blocked | key_padding_mask[:, None, None, :]
    assert not blocked.all(dim=-1).any(), "a fully masked row"
    s = (Q @ K.transpose(-1, -2)) / math.sqrt(hd)
    w = torch.softmax(s.masked_fill(blocked, -math.inf), dim=-1)
    o = (w @ V).transpose(1, 2).reshape(B, L, E)
    out = o @ params["out_proj.weight"].t()
    if "out_proj.bias" in params:
        out = out + params["out_proj.bias"]
    return out, w


def build_mha():
    cases = []

    def add(name, seed, E, H, B, L, S, kdim=None, vdim=None, bias=True, self_attention=False,
            key_padding_mask=None, attn_mask=None):
        torch.manual_seed(seed)
        m = nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, batch_first=True, kdim=kdim, vdim=vdim,
                                  dtype=DTYPE)
        m.eval()
        with torch.no_grad():  # PyTorch initialises biases to 0; make them non-trivial
            if m.in_proj_bias is not None:
                m.in_proj_bias.normal_(0.0, 0.1)
            if m.out_proj.bias is not None:
                m.out_proj.bias.normal_(0.0, 0.1)
        kd, vd = m.kdim, m.vdim
        query = torch.randn(B, L, E)
        if self_attention:
            assert L == S and kd == E and vd == E
            key, value = query.clone(), query.clone()
        else:
            key, value = torch.randn(B, S, kd), torch.randn(B, S, vd)
        query.requires_grad_()
        key.requires_grad_()
        value.requires_grad_()
        d_out = torch.randn(B, L, E)

        out_avg, w_avg = m(query, key, value, key_padding_mask=key_padding_mask, need_weights=True,
                           attn_mask=attn_mask, average_attn_weights=True)
        out_ph, w_ph = m(query, key, value, key_padding_mask=key_padding_mask, need_weights=True,
                         attn_mask=attn_mask, average_attn_weights=False)
        check(f"{name}: out (averaged vs per-head call)", out_avg, out_ph)
        names = [n for n, _ in m.named_parameters()]
        params = dict(m.named_parameters())
        grads = torch.autograd.grad(out_avg, [params[n] for n in names] + [query, key, value], d_out)
        grad_of = dict(zip(names + ["query", "key", "value"], grads))

        # route 2: the same computation written out by hand
        cfg = {"embed_dim": E, "num_heads": H}
        out_m, w_m = mha_math(params, cfg, query, key, value, key_padding_mask, attn_mask)
        check(f"{name}: out vs explicit math", out_m, out_avg)
        check(f"{name}: per-head weights vs explicit math", w_m, w_ph)
        check(f"{name}: averaged weights vs explicit math", w_m.mean(dim=1), w_avg)
        grads_m = torch.autograd.grad(out_m, [params[n] for n in names] + [query, key, value], d_out)
        for n, g in zip(names + ["query", "key", "value"], grads_m):
            check(f"{name}: grad {n} vs explicit math", g, grad_of[n])
        # route 3: finite differences on the explicit math
        leaves = [params[n].detach().clone().requires_grad_() for n in names]
        inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]

        def fn(*args):
            p = dict(zip(names, args[:len(names)]))
            return mha_math(p, cfg, *args[len(names):], key_padding_mask, attn_mask)[0]

        assert torch.autograd.gradcheck(fn, tuple(leaves + inputs), eps=1e-6, atol=1e-8)

        parameter_count = sum(p.numel() for p in m.parameters())
        case = {
            "name": name,
            "config": {"embed_dim": E, "num_heads": H, "kdim": kd, "vdim": vd, "bias": bias,
                       "batch_first": True, "dropout": 0.0},
            "self_attention": self_attention,
            "parameter_names": names,
            "parameters": {n: enc(params[n]) for n in names},
            "parameter_count": parameter_count,
            "inputs": {"query": enc(query), "key": enc(key), "value": enc(value)},
            "masks": {
                "key_padding_mask": enc(key_padding_mask) if key_padding_mask is not None else None,
                "attn_mask": enc(attn_mask) if attn_mask is not None else None,
            },
            "outputs": {"out": enc(out_avg), "weights_averaged": enc(w_avg), "weights_per_head": enc(w_ph)},
            "backward": {
                "d_out": enc(d_out),
                "grads": {n: enc(g) for n, g in grad_of.items()},
            },
        }
        if self_attention:
            case["backward"]["grads"]["self_input"] = enc(grad_of["query"] + grad_of["key"] + grad_of["value"])
        cases.append(case)
        print(f"  mha {name}: ok ({parameter_count} parameters; explicit math, gradcheck)")

    # (a) self-attention with key padding and a Boolean attn_mask (both True = blocked)
    torch.manual_seed(7)
    L = 5
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    am = torch.rand(L, L) < 0.35
    am[:, 0] = False  # key 0 is never blocked: no fully masked row
    add("self_attention_masked", 101, 8, 2, 2, L, L, self_attention=True, key_padding_mask=kpm, attn_mask=am)
    # (b) cross-attention, L != S, key padding only
    add("cross_attention_L3_S5", 102, 8, 2, 2, 3, 5,
        key_padding_mask=torch.tensor([[False] * 5, [False, False, True, True, True]]))
    # (c) kdim, vdim != embed_dim: separate q/k/v_proj_weight
    torch.manual_seed(8)
    am_c = torch.rand(4, 6) < 0.3
    am_c[:, 2] = False
    add("kdim5_vdim6", 103, 8, 2, 2, 4, 6, kdim=5, vdim=6, attn_mask=am_c)
    # (d) bias=False
    add("no_bias", 104, 8, 4, 2, 4, 4, bias=False, self_attention=True)

    write_golden("mha.json", {
        "conventions": {
            "module": "torch.nn.MultiheadAttention(embed_dim, num_heads, bias, batch_first=True, kdim, vdim), "
                      "eval mode, dropout 0; biases re-drawn from N(0, 0.1) after construction",
            "inputs": "query [B,L,E], key [B,S,kdim], value [B,S,vdim]",
            "key_padding_mask": "[B,S] bool, 1 = ignore this key",
            "attn_mask": "[L,S] bool, 1 = not allowed",
            "outputs": "out [B,L,E], weights_averaged [B,L,S] (mean over heads), weights_per_head [B,H,L,S]",
            "backward": "grads of sum(out * d_out) w.r.t. every parameter (PyTorch names) and query/key/value; "
                        "self_input = query + key + value grads (self-attention called as f(x, x, x))",
        },
        "cases": cases,
    })


# ----------------------------------------------------------------------------------------------
# positions
# ----------------------------------------------------------------------------------------------

def sinusoidal_table(length, dim):
    pe = torch.zeros(length, dim)
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / (10000.0 ** (2 * i / dim))
            pe[pos, 2 * i] = math.sin(angle)
            pe[pos, 2 * i + 1] = math.cos(angle)
    return pe


def sinusoidal_table_tutorial(length, dim):
    position = torch.arange(length, dtype=DTYPE).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, dim, 2, dtype=DTYPE) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128,
                                log_dtype=torch.float32):
    """HuggingFace transformers T5Attention._relative_position_bucket, verbatim logic
    (HF computes the log in float32 via .float(); log_dtype lets us check float64 agrees)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    # now relative_position is in the range [0, inf)

    # half of the buckets are for exact increments in positions
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact

    # The other half of the buckets are for logarithmically bigger bins in positions up to max_distance
    relative_position_if_large = max_exact + (
        torch.log(relative_position.to(log_dtype) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )

    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def alibi_get_slopes(n):
    """The ALiBi reference implementation's get_slopes (Press et al.)."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + alibi_get_slopes(2 * closest_power_of_2)[0::2][:n - closest_power_of_2])


def alibi_closed_form(n):
    p = 2 ** math.floor(math.log2(n))
    slopes = [2.0 ** (-8.0 * (i + 1) / p) for i in range(p)]
    slopes += [2.0 ** (-8.0 * (2 * i + 1) / (2 * p)) for i in range(n - p)]
    return slopes


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary(x, dim, base, offset, layout):
    """x [B, H, L, head_dim]; rotate the first `dim` features of each head, pass the rest."""
    L = x.shape[2]
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=DTYPE) / dim))
    pos = torch.arange(offset, offset + L, dtype=DTYPE)
    freqs = torch.outer(pos, inv_freq)  # [L, dim/2]
    if layout == "half_split":  # GPT-NeoX / LLaMA (HF)
        emb = torch.cat((freqs, freqs), dim=-1)
        rot = x_rot * emb.cos() + rotate_half(x_rot) * emb.sin()
    elif layout == "interleaved":  # GPT-J: pair (x[2i], x[2i+1]) rotated by pos * inv_freq[i]
        cos = freqs.cos().repeat_interleave(2, dim=-1)
        sin = freqs.sin().repeat_interleave(2, dim=-1)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rot_every_two = torch.stack((-x2, x1), dim=-1).flatten(-2)
        rot = x_rot * cos + rot_every_two * sin
    else:
        raise ValueError(layout)
    return torch.cat((rot, x_pass), dim=-1), freqs


def rotary_complex(x, dim, freqs, layout):
    """Route 2: multiply complex pairs by exp(i * angle)."""
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    if layout == "half_split":  # pair (x[i], x[i + dim/2])
        pairs = torch.stack((x_rot[..., : dim // 2], x_rot[..., dim // 2:]), dim=-1)
    else:  # pair (x[2i], x[2i+1])
        pairs = x_rot.reshape(*x_rot.shape[:-1], dim // 2, 2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(freqs), freqs)
    r = torch.view_as_real(z)
    if layout == "half_split":
        rot = torch.cat((r[..., 0], r[..., 1]), dim=-1)
    else:
        rot = r.flatten(-2)
    return torch.cat((rot, x_pass), dim=-1)


def build_positions():
    torch.manual_seed(20240603)
    body = {}

    # (a) sinusoidal
    table = sinusoidal_table(50, 16)
    check("sinusoidal vs tutorial formula", sinusoidal_table_tutorial(50, 16), table)
    body["sinusoidal"] = {"length": 50, "dim": 16, "table": enc(table)}
    print("  positions sinusoidal: ok")

    # (b) T5 buckets
    rel = torch.arange(-300, 301, dtype=torch.long)
    t5 = []
    for bidirectional, nb, md in ((True, 32, 128), (False, 32, 128), (True, 16, 64), (False, 16, 64)):
        buckets = t5_relative_position_bucket(rel, bidirectional, nb, md)
        check_exact(f"t5 bidirectional={bidirectional} nb={nb} md={md}: float32 vs float64 log",
                    buckets, t5_relative_position_bucket(rel, bidirectional, nb, md, log_dtype=DTYPE))
        assert int(buckets.min()) >= 0 and int(buckets.max()) < nb
        t5.append({"bidirectional": bidirectional, "num_buckets": nb, "max_distance": md,
                   "relative_position": enc(rel), "bucket": enc(buckets)})
    body["t5_relative_position_bucket"] = {
        "relative_position_definition": "memory_position - query_position (key minus query)",
        "cases": t5,
    }
    print("  positions t5 buckets: ok")

    # (c) ALiBi slopes
    alibi = []
    for n in (8, 12, 6, 1, 16):
        slopes = torch.tensor(alibi_get_slopes(n))
        check(f"alibi {n} vs closed form", torch.tensor(alibi_closed_form(n)), slopes, tol=1e-15)
        alibi.append({"heads": n, "slopes": enc(slopes)})
    body["alibi_slopes"] = {"cases": alibi}
    print("  positions alibi: ok")

    # (d) rotary
    x = torch.randn(1, 2, 5, 8)
    rot_cases = []
    for layout in ("half_split", "interleaved"):
        for dim in (8, 4):
            for offset in (0, 7):
                out, freqs = rotary(x, dim, 10000.0, offset, layout)
                check(f"rotary {layout} dim={dim} offset={offset} vs complex", rotary_complex(x, dim, freqs, layout), out)
                check_exact("rotary pass-through", out[..., dim:], x[..., dim:])
                rot_cases.append({"name": f"{layout}_dim{dim}_offset{offset}", "layout": layout, "dim": dim,
                                  "base": 10000.0, "position_offset": offset, "x": enc(x), "out": enc(out)})
    # the two layouts are the same rotation up to a permutation of features
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # half_split feature order -> interleaved pairs
    inv = torch.argsort(perm)
    hs, _ = rotary(x, 8, 10000.0, 7, "half_split")
    il, _ = rotary(x[..., perm], 8, 10000.0, 7, "interleaved")
    check("rotary half_split == permuted interleaved", il[..., inv], hs)
    body["rotary"] = {
        "conventions": {
            "x": "[B,H,L,head_dim]; token l has position position_offset + l",
            "inv_freq": "1 / base^(arange(0, dim, 2) / dim)",
            "half_split": "GPT-NeoX/LLaMA: emb = cat(freqs, freqs); x*cos + rotate_half(x)*sin, "
                          "rotate_half(x) = cat(-x2, x1)",
            "interleaved": "GPT-J: pair (x[2i], x[2i+1]) rotated by angle pos * inv_freq[i]",
            "dim": "rotary dim; features dim.. of head_dim pass through unchanged",
        },
        "cases": rot_cases,
    }
    print("  positions rotary: ok")

    write_golden("positions.json", body)


# ----------------------------------------------------------------------------------------------
# 16-bit storage: PyTorch's rounding of the inputs, the float64 result on the rounded values, and PyTorch's own
# 16-bit CPU attention
# ----------------------------------------------------------------------------------------------

def bits_of(x16):
    """The raw 16-bit patterns of a float16 / bfloat16 tensor, as non-negative ints."""
    return (x16.view(torch.int16).to(torch.int64) & 0xFFFF)


def build_storage16():
    torch.manual_seed(20261202)
    cases = []
    B, H, Hkv, L, S, D = 1, 4, 2, 5, 21, 16
    allowed = tril_allowed(L, S, S - L)

    def add(name, dtype, magnitude):
        source = [(torch.randn(B, n, length, D) * magnitude).to(torch.float32)
                  for n, length in ((H, L), (Hkv, S), (Hkv, S))]
        rounded = [x.to(dtype) for x in source]
        q, k, v = (x.to(DTYPE) for x in rounded)
        scores = torch.matmul(q, expand_kv(k, H).transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(~allowed, -math.inf)
        out = torch.matmul(torch.softmax(scores, -1), expand_kv(v, H))
        lse = torch.logsumexp(scores, -1)
        # route 2: PyTorch's SDPA in float64 on the same rounded values, GQA expanded the other way
        o2 = F.scaled_dot_product_attention(q, repeat_kv(k, H), repeat_kv(v, H), attn_mask=allowed)
        check(f"{name}: torch SDPA float64", o2, out)
        # PyTorch's own 16-bit CPU attention on the rounded inputs, for the interop check (not an oracle)
        theirs = F.scaled_dot_product_attention(rounded[0], repeat_kv(rounded[1], H), repeat_kv(rounded[2], H),
                                                attn_mask=allowed)
        assert torch.isfinite(theirs.to(DTYPE)).all(), f"{name}: PyTorch's {dtype} attention is not finite"
        cases.append({
            "name": name, "dtype": "half" if dtype == torch.float16 else "bfloat16",
            "q_source": enc(source[0]), "k_source": enc(source[1]), "v_source": enc(source[2]),
            "q_bits": enc(bits_of(rounded[0])), "k_bits": enc(bits_of(rounded[1])),
            "v_bits": enc(bits_of(rounded[2])),
            "out": enc(out), "lse": enc(lse), "torch_out_bits": enc(bits_of(theirs)),
            "max_score": float(scores[torch.isfinite(scores)].abs().max()),
        })
        print(f"  storage16 {name}: ok (torch SDPA float64; largest |score| {cases[-1]['max_score']:.3g})")

    add("half_gqa_causal_bottom_right", torch.float16, 1.0)
    add("bfloat16_gqa_causal_bottom_right", torch.bfloat16, 1.0)
    add("half_scores_beyond_65504", torch.float16, 150.0)
    write_golden("storage16.json", {
        "conventions": {
            "layout": "q [B,H,L,D], k [B,Hkv,S,D], v [B,Hkv,S,D], out [B,H,L,D], lse [B,H,L]",
            "sources": "*_source: float32 values; *_bits: PyTorch's .to(dtype) of them (round to nearest even)",
            "out": "float64 attention on the rounded values (causal bottom-right, scale 1/sqrt(D))",
            "torch_out_bits": "PyTorch's scaled_dot_product_attention on the 16-bit inputs, CPU, as 16-bit bits",
        },
        "cases": cases,
    })


BUILDERS = {
    "sdpa.json": lambda: build_sdpa(),
    "sdpa_backward.json": lambda: build_sdpa_backward(),
    "mha.json": lambda: build_mha(),
    "positions.json": lambda: build_positions(),
    "score_features.json": lambda: build_score_features(),
    "storage16.json": lambda: build_storage16(),
}


def main():
    """Writes every golden file, or only those named on the command line."""
    print(f"torch {torch.__version__}")
    names = sys.argv[1:] or list(BUILDERS)
    for name in names:
        if name not in BUILDERS:
            print(f"unknown golden file {name}; one of {', '.join(BUILDERS)}", file=sys.stderr)
            return 2
        BUILDERS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
