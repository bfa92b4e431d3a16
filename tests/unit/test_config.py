"""PoolConfig, Tuning and the environment table: every bad value is a ConfigurationError
that names the value (and, from the environment, the variable) and the fix; every option
has the variable ``RAY_RDT_POOL_`` + its name (and no other), and ``configure()`` takes
every option as a typed keyword.
No Ray cluster, no NIXL."""

from __future__ import annotations

import inspect
import math
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import pytest

import ray_rdt_pool
from ray_rdt_pool import config as C
from ray_rdt_pool.config import (
    ENV_VARS,
    OPTIONS,
    TUNING_OPTIONS,
    PoolConfig,
    Tuning,
    env_name,
    from_env,
)
from ray_rdt_pool.errors import ConfigurationError


def _make(option: str, value: Any) -> Any:
    """The object that owns ``option``, built with it."""
    return (Tuning if option in TUNING_OPTIONS else PoolConfig)(**{option: value})


@pytest.mark.parametrize(("option", "value", "text"), [
    # A string was truthy: overflow="no" left overflow on, metrics="0" left it on.
    ("overflow", "no", "overflow must be True or False, got 'no'"),
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
        _make(option, value)
    with pytest.raises(ConfigurationError, match=text.replace("(", r"\(")):
        PoolConfig().with_overrides(**{option: value})


def test_options_of_the_right_type_are_taken() -> None:
    cfg = PoolConfig(overflow=False, metrics=False, fetch_timeout_s=30,
                     tuning=Tuning(progress_interval_s=0.01))
    assert not cfg.overflow and not cfg.metrics and cfg.fetch_timeout_s == 30
    assert cfg.tuning.progress_interval_s == 0.01


@pytest.mark.parametrize(("env", "text"), [
    # int(float("1e400")) raised OverflowError out of the first put.
    ({"RAY_RDT_POOL_POOL_BYTES": "1.0e400"}, "RAY_RDT_POOL_POOL_BYTES='1.0e400' is not a size"),
    # A count was told to use a K/M/G suffix ("e.g. RAY_RDT_POOL_READ_LANES=512M").
    ({"RAY_RDT_POOL_READ_LANES": "two"},
     "RAY_RDT_POOL_READ_LANES='two' is not a whole number; e.g. RAY_RDT_POOL_READ_LANES=2"),
    ({"RAY_RDT_POOL_PACK_THREADS": "4K"}, "RAY_RDT_POOL_PACK_THREADS='4K' is not a whole"),
    # A refused value names the variable that set it, not only the field.
    ({"RAY_RDT_POOL_FETCH_TIMEOUT_S": "inf"}, "set by RAY_RDT_POOL_FETCH_TIMEOUT_S='inf'"),
    ({"RAY_RDT_POOL_READ_LANES": "99"}, r"read_lanes must be an int in \[0, .*set by "
                                        "RAY_RDT_POOL_READ_LANES='99'"),
    ({"RAY_RDT_POOL_OVERFLOW": "maybe"}, "RAY_RDT_POOL_OVERFLOW='maybe' is not a boolean"),
])
def test_bad_environment_values_name_the_variable(env: dict[str, str], text: str) -> None:
    with pytest.raises(ConfigurationError, match=text):
        from_env(env)


def test_environment_values_parse() -> None:
    cfg = from_env({"RAY_RDT_POOL_POOL_BYTES": "64M", "RAY_RDT_POOL_READ_LANES": "2",
                    "RAY_RDT_POOL_PACK_THREADS": " 3 ", "RAY_RDT_POOL_OVERFLOW": "no",
                    "RAY_RDT_POOL_FETCH_TIMEOUT_S": "2.5", "RAY_RDT_POOL_SAME_NODE": "Copy"})
    assert (cfg.pool_bytes, cfg.tuning.read_lanes, cfg.tuning.pack_threads) == (64 << 20, 2, 3)
    assert not cfg.overflow and cfg.fetch_timeout_s == 2.5 and cfg.same_node == "copy"


def test_a_longer_progress_interval_alone_is_accepted() -> None:
    """Setting only progress_interval_s above the idle default (0.02 s) was refused, and
    the message suggested progress_idle_interval_s=0.02, the value already in force."""
    assert Tuning(progress_interval_s=0.05).progress_idle_interval_s == 0.05
    cfg = from_env({"RAY_RDT_POOL_PROGRESS_INTERVAL_S": "0.05"}).tuning
    assert (cfg.progress_interval_s, cfg.progress_idle_interval_s) == (0.05, 0.05)
    assert Tuning(progress_interval_s=0.01).progress_idle_interval_s == 0.02
    with pytest.raises(ConfigurationError,
                       match=r"got 0\.03; pass e\.g\. progress_idle_interval_s=0\.05"):
        Tuning(progress_interval_s=0.05, progress_idle_interval_s=0.03)


def test_a_followed_idle_interval_follows_every_later_progress_interval() -> None:
    """The followed idle interval was baked into the config: configure(
    progress_interval_s=0.005) over RAY_RDT_POOL_PROGRESS_INTERVAL_S=0.5 kept an idle
    interval of 0.5 s (new peers then connect a hundred times slower than the default
    says), and an explicit progress_idle_interval_s=0.02 below a longer interval was
    silently raised instead of refused."""
    base = from_env({"RAY_RDT_POOL_PROGRESS_INTERVAL_S": "0.5"})
    assert base.tuning.progress_idle_interval_s == 0.5
    cfg = base.with_overrides(progress_interval_s=0.005)
    assert (cfg.tuning.progress_interval_s, cfg.tuning.progress_idle_interval_s) == (0.005, 0.02)
    assert cfg == PoolConfig(tuning=Tuning(progress_interval_s=0.005))
    again = pickle.loads(pickle.dumps(base)).with_overrides(progress_interval_s=0.1)
    assert again.tuning.progress_idle_interval_s == 0.1
    kept = PoolConfig(tuning=Tuning(progress_idle_interval_s=0.5)).with_overrides(
        progress_interval_s=0.1)
    assert kept.tuning.progress_idle_interval_s == 0.5
    with pytest.raises(ConfigurationError, match=r"got 0\.02; pass e\.g\. "
                                                 r"progress_idle_interval_s=0\.05"):
        Tuning(progress_interval_s=0.05, progress_idle_interval_s=0.02)


# --------------------------------------------------------------------------- the naming rule

#: A value other than the default for each option, as a variable's text and as parsed.
_OTHER: dict[str, tuple[str, Any]] = {
    "pool_bytes": ("3M", 3 << 20), "arena_bytes": ("3M", 3 << 20), "device": ("cuda", "cuda"),
    "overflow": ("0", False), "prefault": ("1", True), "fetch_timeout_s": ("0.5", 0.5),
    "metrics": ("0", False), "debug_transfers": ("1", True),
    "registration_cache_bytes": ("3M", 3 << 20), "same_node": ("copy", "copy"),
    "overflow_linger_s": ("0.5", 0.5), "progress_interval_s": ("0.5", 0.5),
    "progress_idle_interval_s": ("0.5", 0.5), "pack_threads": ("3", 3),
    "pack_threshold_bytes": ("3M", 3 << 20), "stream_copy_bytes": ("3M", 3 << 20),
    "read_lanes": ("3", 3), "read_split_bytes": ("3M", 3 << 20), "native": ("0", False),
}


def test_every_option_has_the_variable_the_rule_names() -> None:
    """A field added to PoolConfig or Tuning without a meaning for its variable, or with
    a name that clashes, fails here; every variable sets the option it is named after."""
    main = [f.name for f in fields(PoolConfig) if f.name != "tuning"]
    tuned = [f.name for f in fields(Tuning)]
    assert not set(main) & set(tuned) and set(tuned) == TUNING_OPTIONS
    assert list(OPTIONS) == main + tuned and set(_OTHER) == set(OPTIONS)
    assert len(ENV_VARS) == len(OPTIONS)
    for option in OPTIONS:
        var = "RAY_RDT_POOL_" + option.upper()
        assert env_name(option) == var and ENV_VARS[var][0] == option
        assert ENV_VARS[var][1], f"{option} has no meaning for {var}: add metadata=_env(...)"
        text, value = _OTHER[option]
        assert value != PoolConfig().options()[option]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a name by the rule is not deprecated
            assert from_env({var: text}).options()[option] == value, var


def test_no_old_name_or_alias_is_read() -> None:
    """0.1.0 is the first release: a variable or keyword from before the naming rule is
    not read, and tuning values live on ``Tuning`` only."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = from_env({"RAY_RDT_POOL_BYTES": "1M", "RAY_RDT_POOL_READ_SPLIT": "0",
                        "RAY_RDT_POOL_STRICT": "1"})
    assert cfg == PoolConfig()
    with pytest.raises(TypeError, match="read_lanes"):
        PoolConfig(read_lanes=3)  # type: ignore[call-arg]
    assert not hasattr(PoolConfig(), "read_lane_count")
    assert PoolConfig(tuning=Tuning(read_lanes=3)).tuning.read_lane_count == 3


def test_tuning_must_be_a_tuning() -> None:
    for make in (lambda: PoolConfig(tuning={"read_lanes": 2}),  # type: ignore[arg-type]
                 lambda: PoolConfig().with_overrides(tuning={"read_lanes": 2})):
        with pytest.raises(ConfigurationError, match=r"tuning must be a ray_rdt_pool\.config"
                                                     r"\.Tuning, got \{'read_lanes': 2\}"):
            make()


# --------------------------------------------------------------------------- configure()


@pytest.fixture()
def fresh_transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """runtime.configure() in a process state where nothing was configured or made."""
    from ray_rdt_pool._ray import runtime as tp

    for name, value in (("_runtime", None), ("_config", None), ("_configured", False)):
        monkeypatch.setattr(tp, name, value)
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    yield tp


def test_configure_has_a_typed_keyword_for_every_option() -> None:
    """An editor completes configure()'s options: its keywords are one TypedDict, with a
    type for every option (None meaning unset), in the package's function and the
    runtime's alike."""
    from typing import get_type_hints

    from ray_rdt_pool._ray import runtime as tp

    hints = get_type_hints(C.Options)
    assert set(hints) == {*OPTIONS, "tuning"}
    for option, hint in hints.items():
        assert type(None) in hint.__args__, option
    for fn in (ray_rdt_pool.configure, tp.configure):
        params = list(inspect.signature(fn).parameters.values())
        assert [(p.kind, p.annotation) for p in params] == [
            (inspect.Parameter.VAR_KEYWORD, "Unpack[Options]")], fn
    doc = inspect.getdoc(ray_rdt_pool.configure) or ""
    assert all(f"``{option}``" in doc for option in (*OPTIONS, "tuning"))


def test_configure_takes_every_option_it_took_before(fresh_transport: Any) -> None:
    """Every keyword configure() took before the tuning values moved (all 19 fields of the
    old PoolConfig) still sets its option, with no warning."""
    given = {option: value for option, (_text, value) in _OTHER.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = ray_rdt_pool.configure(**given)
    assert cfg.options() == given
    assert fresh_transport._config is cfg


def test_configure_takes_tuning_whole_and_one_by_one(fresh_transport: Any) -> None:
    cfg = ray_rdt_pool.configure(tuning=Tuning(read_lanes=3, pack_threads=2), pack_threads=4,
                                 pool_bytes=None)  # None: unset
    assert (cfg.tuning.read_lanes, cfg.tuning.pack_threads) == (3, 4)
    assert cfg.pool_bytes == PoolConfig().pool_bytes


def test_configure_refuses_an_unknown_keyword_with_the_typed_error(fresh_transport: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown configuration option\(s\) "
                       r"\['pool_size'\]; 'pool_size': did you mean 'pool_bytes'\? known "
                       r"options are \['arena_bytes', .*'stream_copy_bytes'\] and tuning"):
        ray_rdt_pool.configure(pool_size=1 << 20)  # type: ignore[arg-type]
    assert fresh_transport._config is None and not fresh_transport._configured
    with pytest.raises(ConfigurationError, match=r"\['bogus'\]; known options"):
        fresh_transport.configure(bogus=1)  # type: ignore[arg-type]


def test_configure_again_names_what_differs(fresh_transport: Any) -> None:
    ray_rdt_pool.configure(pool_bytes=1 << 20, read_lanes=2)
    with pytest.raises(ConfigurationError, match=r"other values \{'read_lanes': \(2, 3\)\}"):
        ray_rdt_pool.configure(pool_bytes=1 << 20, read_lanes=3)
    ray_rdt_pool.configure(pool_bytes=1 << 20, read_lanes=2)  # the same again is fine


def test_configure_reads_the_new_names_under_its_keywords(
        fresh_transport: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_RDT_POOL_STREAM_COPY_BYTES", "1M")
    monkeypatch.setenv("RAY_RDT_POOL_POOL_BYTES", "2M")
    cfg = ray_rdt_pool.configure(arena_bytes=3 << 20)
    assert (cfg.pool_bytes, cfg.arena_bytes, cfg.tuning.stream_copy_bytes) == (
        2 << 20, 3 << 20, 1 << 20)


def _readme_config_rows() -> dict[str, tuple[str, str]]:
    """option -> (environment variable, default) from the options table of
    docs/configuration.md."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
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
    """Each row of docs/configuration.md's tables names an option (``read_lanes`` or
    ``tuning.read_lanes`` for a tuning one), the environment variable that sets it and
    its default, as the code has them; every option and variable has a row. A user who
    sets what the table says sets the option it names."""
    rows = {option.removeprefix("tuning."): row
            for option, row in _readme_config_rows().items()}
    assert set(rows) == set(OPTIONS)
    default = PoolConfig().options()
    for option, (_var, text) in rows.items():
        assert _documented_default(text) == default[option], (option, text)
    assert {var for var, _d in rows.values()} == set(ENV_VARS)
    for option, (var, _text) in rows.items():
        assert var == env_name(option), (option, var)
