"""The README's code blocks found, and the docs held to the code.

README blocks: every fenced block whose info string is exactly ``python`` is extracted
(and run by tests/integration/test_readme_blocks.py).

The docs. ``python tools/gen_docs.py --check`` must pass (docs/api.md and the options
table of docs/configuration.md are what the code generates); every error class of
``ray_rdt_pool.errors`` and ``ray_rdt_pool.weights`` has its section in
docs/troubleshooting.md; the names the README and docs/ use for ``stats()`` fields,
environment variables (the code's messages included) and metrics exist; relative links
and their anchors resolve; docs/ holds at most 150 KB of Markdown and no path of the
machine it was written on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: Every Markdown file a user reads: the README, the changelog and docs/.
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose info string is ``python``, in order."""
    return [body for info, body in _FENCE.findall(text) if info.strip() == "python"]


def promised_lines(block: str) -> list[str]:
    """The ``TEXT`` of each ``print(...)  # TEXT`` line of a block."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+)$", block, re.M)]


def test_the_readme_has_python_blocks_and_the_two_make_commands() -> None:
    text = README.read_text()
    assert len(python_blocks(text)) >= 2
    assert "make test" in text and "make bench" in text


def test_block_extraction_keeps_only_python_blocks() -> None:
    text = "```bash\npip install .\n```\n\n```python\nprint(1)  # 1\n```\n\n```py\nx\n```\n"
    assert python_blocks(text) == ["print(1)  # 1\n"]
    assert promised_lines(python_blocks(text)[0]) == ["1"]


def test_generated_docs_are_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_error_class_has_a_troubleshooting_section() -> None:
    from ray_rdt_pool import errors, weights

    headings = set(re.findall(r"^### `(\w+)`", (ROOT / "docs" / "troubleshooting.md")
                              .read_text(), re.M))
    classes = {name for module in (errors, weights) for name in module.__all__
               if isinstance(getattr(module, name), type)
               and issubclass(getattr(module, name), BaseException)}
    assert classes - headings == set()
    assert headings - classes == set()


def test_names_the_docs_use_exist() -> None:
    """``stats().x``, ``RAY_RDT_POOL_*`` and ``ray_rdt_pool_*`` metric names in the README
    and docs/ are fields, variables and series the code has."""
    from ray_rdt_pool._ray.patches import ALLOW_UNTESTED_ENV
    from ray_rdt_pool.config import ENV_VARS
    from ray_rdt_pool.memory.native import DIR_ENV
    from ray_rdt_pool.obs import metrics
    from ray_rdt_pool.obs.stats import TransportStats

    fields = set(TransportStats.__dataclass_fields__) | {"pool_fragmentation"}
    series = {metrics.PREFIX + name for name, _d, _f in metrics.GAUGES}
    series |= {metrics.PREFIX + name + "_total" for name, _d, _f in metrics.COUNTERS}
    series |= {metrics.PREFIX + name for name, _d in metrics.HISTOGRAMS}
    series.add(metrics.PREFIX + metrics.ERRORS_NAME + "_total")
    text = "\n".join(p.read_text() for p in PAGES if p.name != "CHANGELOG.md")
    used_fields = set(re.findall(r"stats\(\)\.(\w+)", text))
    assert used_fields - fields == set()
    # The code's messages too: a hint that names a variable nothing reads misleads.
    code = "\n".join(p.read_text() for p in (ROOT / "ray_rdt_pool").rglob("*.py"))
    used_vars = set(re.findall(r"\bRAY_RDT_POOL_[A-Z_]*[A-Z]\b", text + code))
    known = set(ENV_VARS) | {DIR_ENV, ALLOW_UNTESTED_ENV}
    assert used_vars - known == set()
    used_series = {m.removeprefix("ray_") for m in re.findall(r"\bray_rdt_pool_[a-z_]+", text)}
    assert used_series - series == set()


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens, ``-1``, ``-2`` for repeats (headings inside code blocks are not headings)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_and_their_anchors_resolve() -> None:
    broken = []
    pages = [*PAGES, ROOT / "ARCHITECTURE.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = page if not path else page.parent / path
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_anchors_follow_github_s_rule() -> None:
    text = "# Weight sync\n## `sync(..., wait=False)`\n## Limits\n## Limits\n```\n# no\n```\n"
    assert _anchors(text) == {"weight-sync", "sync-waitfalse", "limits", "limits-1"}


def test_docs_stay_small_and_name_no_machine_paths() -> None:
    assert sum(p.stat().st_size for p in DOCS) <= 150_000
    for page in PAGES:
        assert "/work/" not in page.read_text(), page.name


def test_the_weights_api_is_small_and_holds_no_planning_internal() -> None:
    """``ray_rdt_pool.weights`` exports what a user calls or catches; the layout and
    planning types live in ``ray_rdt_pool.weights.advanced``."""
    import ray_rdt_pool.weights as W
    from ray_rdt_pool.weights import advanced

    assert len(W.__all__) <= 30 and len(set(W.__all__)) == len(W.__all__)
    assert not set(W.__all__) & set(advanced.__all__)
    for name in (*W.__all__, *advanced.__all__):
        assert hasattr(W if name in W.__all__ else advanced, name), name


def test_reliability_rows_cite_tests_that_exist_and_say_which_run_on_fake_nixl() -> None:
    """Each test a row of docs/reliability.md cites exists (``file.py::name``, ``::name``
    in the same file, or a bare name in test_reliability.py), and a row says *(fake
    NIXL)* exactly when it cites a test of tests/unit (which runs on the fake)."""
    tests = ROOT / "tests"
    defs: dict[str, set[str]] = {}
    for path in tests.rglob("test_*.py"):
        found = re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M)
        defs.setdefault(path.name, set()).update(found)
    unit = {p.name for p in (tests / "unit").rglob("test_*.py")}
    problems = []
    for line in (ROOT / "docs" / "reliability.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| what"):
            continue
        current, fake = "test_reliability.py", False
        for token in re.findall(r"`([^`]+)`", line.split("|")[-2]):
            m = re.fullmatch(r"(?:[\w/]+/)?(test_\w+\.py)(?:::(\w+))?|::(\w+)|(test_\w+)", token)
            if m is None:
                continue
            if m.group(1):
                current = m.group(1)
            elif m.group(4):
                current = "test_reliability.py"
            name = m.group(2) or m.group(3) or m.group(4)
            if current not in defs or (name and name not in defs[current]):
                problems.append(f"{token}: no such test ({line[:60]}...)")
            fake = fake or current in unit
        if fake != ("fake NIXL" in line):
            problems.append(f"{'unmarked' if fake else 'marked'} row: {line[:70]}...")
    assert problems == []
