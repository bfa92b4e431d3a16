"""The example programs, run as a user runs them: ``python examples/NAME.py``.

Each starts its own local Ray cluster in a subprocess, in an environment without this
package's settings or a Ray address (as on a user's machine), and must exit 0 and print
its success lines. ``tests/test_weights_hf.py`` runs the Hugging Face example.

* ``examples/put_get.py``: one actor puts two tensors, another reads them; the sums match.
* ``examples/weight_sync.py``, two steps each: ``--mode both`` (a stream whose receivers
  read the trainer's tensors in place, then a publish through a 2 MiB pool) and
  ``--packed`` (a stream that packs every bucket through a 256 KiB pool, smaller than the
  model). Both run with ``torch.use_deterministic_algorithms(True)`` in every actor.
"""

from __future__ import annotations

import re

import pytest

from tests.raycluster import run_example

pytestmark = pytest.mark.ray


def test_example_put_get() -> None:
    out = run_example("put_get.py")
    assert re.search(r"^received 2 tensors, sums match: \[\S+, \S+\]$", out, re.M), out


def _steps(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


def test_example_weight_sync_stream_in_place_then_publish() -> None:
    out = run_example("weight_sync.py", "--steps", "2", "--mode", "both")
    steps = _steps(out)
    assert [line.split()[4] for line in steps] == ["stream", "publish"], out
    for line in steps:
        assert "fp32 bit-exact [True, True]" in line and "bf16 bit-exact True" in line, out
    # The stream was read in place (nothing packed), the publish put its 9 buckets.
    assert "objects put 9, stream buckets read in place 9/9" in out, out
    assert "fallbacks 0" in out
    assert out.rstrip().endswith("OK: all checks passed"), out


def test_example_weight_sync_packed_stream_stays_within_its_pool() -> None:
    out = run_example("weight_sync.py", "--steps", "2", "--packed")
    steps = _steps(out)
    assert len(steps) == 2 and all("fp32 bit-exact [True, True]" in s for s in steps), out
    m = re.search(r"sender pool ([\d,]+) bytes, streaming peak ([\d,]+) bytes, fallbacks 0, "
                  r"objects put 18, stream buckets read in place 0/18", out)
    assert m, out
    capacity, peak = (int(g.replace(",", "")) for g in m.groups())
    assert capacity == 256 << 10 and 0 < peak <= 2 * (128 << 10), out
    assert out.rstrip().endswith("OK: all checks passed"), out
