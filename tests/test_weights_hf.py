"""The Hugging Face weight-sync example, in its reduced size (``--small``).

It starts its own local Ray cluster in a subprocess, trains a tiny ``LlamaForCausalLM``
(built from a config, nothing downloaded) for a few steps in a trainer actor, syncs it to
two inference actors after every step (fp32 on the wire: logits bit-exact) and once with
bf16 on the wire (half the bytes; logits equal to the bf16-rounded trainer's), and exits
0 only if every check passes.
"""

from __future__ import annotations

import re

import pytest

from tests.raycluster import run_example

pytestmark = pytest.mark.ray


def test_example_weight_sync_hf_small() -> None:
    pytest.importorskip("transformers")
    out = run_example("weight_sync_hf.py", "--small", "--steps", "2", timeout=180)
    assert "OK: all checks passed" in out
    assert out.count("logits bit-exact [True, True]") == 2
    m = re.search(r"bf16 wire: .* \((0\.\d+) of fp32\)", out)
    assert m and 0.45 < float(m.group(1)) < 0.55, out
    assert "fallbacks 0" in out
