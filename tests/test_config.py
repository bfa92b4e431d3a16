"""PoolConfig and the environment table: every bad value is a ConfigurationError that
names the value (and, from the environment, the variable) and the fix. No Ray, no NIXL."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest

from ray_rdt_pool.config import ENV_VARS, PoolConfig, from_env
from ray_rdt_pool.errors import ConfigurationError


@pytest.mark.parametrize(("option", "value", "text"), [
    # A string was truthy: strict="no" turned strict mode on, metrics="0" left it on.
    ("strict", "no", "strict must be True or False, got 'no'"),
    ("metrics", "0", "metrics must be True or False, got '0'"),
    ("native", "false", "native must be True or False"),
    ("prefault", 1, "prefault must be True or False, got 1"),
    ("debug_transfers", None, "debug_transfers must be True or False"),
    # Compared with a number: an untyped TypeError.
    ("fetch_timeout_s", "30", "fetch_timeout_s must be a finite number of seconds, got '30'"),
    ("fetch_timeout_s", None, "fetch_timeout_s must be a finite number of seconds"),
    ("fetch_timeout_s", math.inf, "got inf; pass e.g. fetch_timeout_s=60.0"),
    ("fetch_timeout_s", True, "fetch_timeout_s must be a finite number of seconds, got True"),
    ("progress_interval_s", "0.01", "progress_interval_s must be a finite number"),
    ("progress_idle_interval_s", None, "progress_idle_interval_s must be a finite number"),
    # math.isfinite of an int too large for a float raised a raw OverflowError.
    pytest.param("fetch_timeout_s", 10 ** 400, "fetch_timeout_s must be a finite number of "
                 "seconds", id="fetch_timeout_s-int-too-large-for-a-float"),
])
def test_options_of_the_wrong_type_are_refused(option: str, value: Any, text: str) -> None:
    with pytest.raises(ConfigurationError, match=text.replace("(", r"\(")):
        PoolConfig(**{option: value})
    with pytest.raises(ConfigurationError, match=text.replace("(", r"\(")):
        PoolConfig().with_overrides(**{option: value})


def test_options_of_the_right_type_are_taken() -> None:
    cfg = PoolConfig(strict=True, metrics=False, fetch_timeout_s=30, progress_interval_s=0.01)
    assert cfg.strict and not cfg.metrics and cfg.fetch_timeout_s == 30


@pytest.mark.parametrize(("env", "text"), [
    # int(float("1e400")) raised OverflowError out of the first put.
    ({"RAY_RDT_POOL_BYTES": "1.0e400"}, "RAY_RDT_POOL_BYTES='1.0e400' is not a size"),
    # A count was told to use a K/M/G suffix ("e.g. RAY_RDT_POOL_READ_LANES=512M").
    ({"RAY_RDT_POOL_READ_LANES": "two"},
     "RAY_RDT_POOL_READ_LANES='two' is not a whole number; e.g. RAY_RDT_POOL_READ_LANES=2"),
    ({"RAY_RDT_POOL_PACK_THREADS": "4K"}, "RAY_RDT_POOL_PACK_THREADS='4K' is not a whole"),
    # A refused value names the variable that set it, not only the field.
    ({"RAY_RDT_POOL_FETCH_TIMEOUT_S": "inf"}, "set by RAY_RDT_POOL_FETCH_TIMEOUT_S='inf'"),
    ({"RAY_RDT_POOL_READ_LANES": "99"}, r"read_lanes must be an int in \[0, .*set by "
                                        "RAY_RDT_POOL_READ_LANES='99'"),
    ({"RAY_RDT_POOL_STRICT": "maybe"}, "RAY_RDT_POOL_STRICT='maybe' is not a boolean"),
])
def test_bad_environment_values_name_the_variable(env: dict[str, str], text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        from_env(env)


def test_environment_values_parse() -> None:
    cfg = from_env({"RAY_RDT_POOL_BYTES": "64M", "RAY_RDT_POOL_READ_LANES": "2",
                    "RAY_RDT_POOL_PACK_THREADS": " 3 ", "RAY_RDT_POOL_STRICT": "yes",
                    "RAY_RDT_POOL_FETCH_TIMEOUT_S": "2.5", "RAY_RDT_POOL_SAME_NODE": "Copy"})
    assert (cfg.pool_bytes, cfg.read_lanes, cfg.pack_threads) == (64 << 20, 2, 3)
    assert cfg.strict and cfg.fetch_timeout_s == 2.5 and cfg.same_node == "copy"
    assert {name for name, _doc in ENV_VARS.values()} <= set(PoolConfig.__dataclass_fields__)


def test_a_longer_progress_interval_alone_is_accepted() -> None:
    """Setting only progress_interval_s above the idle default (0.02 s) was refused, and
    the message suggested progress_idle_interval_s=0.02, the value already in force."""
    assert PoolConfig(progress_interval_s=0.05).progress_idle_interval_s == 0.05
    cfg = from_env({"RAY_RDT_POOL_PROGRESS_INTERVAL_S": "0.05"})
    assert (cfg.progress_interval_s, cfg.progress_idle_interval_s) == (0.05, 0.05)
    assert PoolConfig(progress_interval_s=0.01).progress_idle_interval_s == 0.02
    with pytest.raises(ConfigurationError,
                       match=r"got 0\.03; pass e\.g\. progress_idle_interval_s=0\.05"):
        PoolConfig(progress_interval_s=0.05, progress_idle_interval_s=0.03)


def test_a_followed_idle_interval_follows_every_later_progress_interval() -> None:
    """The followed idle interval was baked into the config: configure(
    progress_interval_s=0.005) over RAY_RDT_POOL_PROGRESS_INTERVAL_S=0.5 kept an idle
    interval of 0.5 s (new peers then connect a hundred times slower than the default
    says), and an explicit progress_idle_interval_s=0.02 below a longer interval was
    silently raised instead of refused."""
    base = from_env({"RAY_RDT_POOL_PROGRESS_INTERVAL_S": "0.5"})
    assert base.progress_idle_interval_s == 0.5
    cfg = base.with_overrides(progress_interval_s=0.005)
    assert (cfg.progress_interval_s, cfg.progress_idle_interval_s) == (0.005, 0.02)
    assert cfg == PoolConfig(progress_interval_s=0.005)
    again = pickle.loads(pickle.dumps(base)).with_overrides(progress_interval_s=0.1)
    assert again.progress_idle_interval_s == 0.1
    kept = PoolConfig(progress_idle_interval_s=0.5).with_overrides(progress_interval_s=0.1)
    assert kept.progress_idle_interval_s == 0.5
    with pytest.raises(ConfigurationError, match=r"got 0\.02; pass e\.g\. "
                                                 r"progress_idle_interval_s=0\.05"):
        PoolConfig(progress_interval_s=0.05, progress_idle_interval_s=0.02)


def _readme_config_rows() -> dict[str, tuple[str, str]]:
    """option -> (environment variable, default) from the options table of
    docs/configuration.md."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    rows: dict[str, tuple[str, str]] = {}
    for line in text.split("## Options", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[1].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    return rows


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _documented_default(text: str) -> Any:
    if text in ("on", "off"):
        return text == "on"
    if text.startswith("`"):
        return text.strip("`")
    number, _, rest = text.partition(" ")
    if rest.split(" ")[0] in _UNITS:
        return int(number) * _UNITS[rest.split(" ")[0]]
    return float(number) if "." in number else int(number)


def test_the_readme_configuration_table_is_the_config() -> None:
    """Each row of docs/configuration.md's table names a PoolConfig field, the variable
    that sets it and its default, as the code has them; every option and variable has a
    row. A user who sets what the table says sets the option it names."""
    rows = _readme_config_rows()
    fields = PoolConfig.__dataclass_fields__
    assert set(rows) == set(fields)
    assert {var for var, _d in rows.values()} == set(ENV_VARS)
    default = PoolConfig()
    for option, (var, text) in rows.items():
        assert ENV_VARS[var][0] == option, (option, var)
        assert _documented_default(text) == getattr(default, option), (option, text)
