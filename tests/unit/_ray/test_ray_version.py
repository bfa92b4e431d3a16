"""register() on a Ray other than the tested minor release is a typed error that names
both versions and the fix; RAY_RDT_POOL_ALLOW_UNTESTED_RAY=1 turns it into one warning.
The installed version is monkeypatched, so no cluster is needed."""

from __future__ import annotations

import warnings

import pytest
import ray

import ray_rdt_pool
from ray_rdt_pool._ray import patches
from ray_rdt_pool.errors import ConfigurationError


@pytest.fixture()
def untested_ray(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    monkeypatch.setattr(patches, "_warned_untested", False)
    monkeypatch.delenv(patches.ALLOW_UNTESTED_ENV, raising=False)
    return "2.61.0"


def test_register_on_an_untested_ray_is_a_configuration_error(
        untested_ray: str, monkeypatch: pytest.MonkeyPatch) -> None:
    applied: list[bool] = []
    monkeypatch.setattr(patches, "apply", lambda: applied.append(True))
    with pytest.raises(ConfigurationError) as info:
        ray_rdt_pool.register()
    text = str(info.value)
    assert "Ray 2.61.0 is installed" in text and "tested with Ray 2.60.x" in text
    assert "ray[default]==2.60.*" in text and "RAY_RDT_POOL_ALLOW_UNTESTED_RAY=1" in text
    assert applied == []  # nothing of Ray's was changed


@pytest.mark.parametrize("version", ["2.60.0", "2.60.7", "2.60.1rc1"])
def test_every_release_of_the_tested_minor_passes(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patches.check_ray_version(version)


@pytest.mark.parametrize("version", ["2.59.2", "2.6.0", "2.600.0", "3.0.0.dev0"])
def test_other_minors_are_refused(version: str, untested_ray: str) -> None:
    with pytest.raises(ConfigurationError, match=f"Ray {version} is installed"):
        patches.check_ray_version(version)


def test_the_escape_hatch_warns_once_instead(untested_ray: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(patches.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="Ray 2.61.0 is installed"):
        patches.check_ray_version()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patches.check_ray_version()  # once per process: register() runs in every actor


def test_a_bad_escape_hatch_value_is_a_configuration_error(
        untested_ray: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(patches.ALLOW_UNTESTED_ENV, "maybe")
    with pytest.raises(ConfigurationError, match="RAY_RDT_POOL_ALLOW_UNTESTED_RAY='maybe'"):
        patches.check_ray_version()
