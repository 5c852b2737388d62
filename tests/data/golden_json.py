# SPDX-License-Identifier: MIT
"""The JSON layout of the golden files the generators beside this file write."""

import json


def dumps_golden(obj, indent=0):
    """Pretty JSON with every list of scalars on one line (small, diffable files)."""
    pad = " " * indent
    inner = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps_golden(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}" if items else "{}"
    if isinstance(obj, list):
        if all(not isinstance(x, (dict, list)) for x in obj):
            return json.dumps(obj, separators=(",", ":"), allow_nan=False)
        return "[\n" + ",\n".join(inner + dumps_golden(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, allow_nan=False)
