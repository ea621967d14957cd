"""MultiStorageClientFeature: Megatron-Core's switch, on only when enabled and the package is installed."""

import importlib.util
import pickle

import pytest

from megatron.core.msc_utils import MultiStorageClientFeature, _FeatureFlag


def test_disabled_by_default_and_switchable():
    flag = _FeatureFlag("json", "it is in the standard library")
    assert not flag.is_enabled()
    flag.enable()
    assert flag.is_enabled() and flag.import_package().__name__ == "json"
    flag.disable()
    with pytest.raises(RuntimeError, match=r"json feature is disabled: call MultiStorageClientFeature.enable\(\)"):
        flag.import_package()
    assert pickle.loads(pickle.dumps(flag)).is_enabled() is False


@pytest.mark.skipif(importlib.util.find_spec("multistorageclient") is not None, reason="the package is installed")
def test_enabling_without_the_package_stays_off_and_says_how_to_install():
    MultiStorageClientFeature.enable()
    try:
        assert not MultiStorageClientFeature.is_enabled()
        with pytest.raises(RuntimeError, match="pip install multi-storage-client"):
            MultiStorageClientFeature.import_package()
    finally:
        MultiStorageClientFeature.disable()
