"""The Hugging Face weight-sync example, in its reduced size (``--small``).

It starts its own local Ray cluster in a subprocess, trains a tiny ``LlamaForCausalLM``
(built from a config, nothing downloaded) for a few steps in a trainer actor, syncs it to
two inference actors after every step (fp32 on the wire: logits bit-exact) and once with
bf16 on the wire (half the bytes; logits equal to the bf16-rounded trainer's), and exits
0 only if every check passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent


def test_example_weight_sync_hf_small() -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "weight_sync_hf.py"), "--small", "--steps", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "OK: all checks passed" in out
    assert out.count("logits bit-exact [True, True]") == 2
    m = re.search(r"bf16 wire: .* \((0\.\d+) of fp32\)", out)
    assert m and 0.45 < float(m.group(1)) < 0.55, out
    assert "fallbacks 0" in out
