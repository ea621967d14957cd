"""typed_torch: the copied signature is what inspect reports, and bad input names the parameter."""

import inspect

import pytest
import torch

from megatron.core.typed_torch import apply_module, copy_signature, not_none


def target(x: int, *, scale: float = 1.0) -> float:
    return x * scale


class Holder:
    def method(self, x: int) -> str:
        return str(x)


def test_copied_signature_keeps_own_return_unless_overwritten():
    @copy_signature(target)
    def wrapper(*args, **kwargs) -> list:
        return [target(*args, **kwargs)]

    @copy_signature(target, handle_return_type="overwrite")
    def same(*args, **kwargs):
        return target(*args, **kwargs)

    assert list(inspect.signature(wrapper).parameters) == ["x", "scale"]
    assert inspect.signature(wrapper).return_annotation is list
    assert inspect.signature(same).return_annotation is float
    assert wrapper(2, scale=3.0) == [6.0]


def test_first_parameters_skipped_and_preserved():
    class Wrapper:
        @copy_signature(Holder.method, handle_first_src_param="skip", handle_first_dst_param="preserve")
        def method(self, *args, **kwargs):
            return Holder().method(*args, **kwargs)

    assert list(inspect.signature(Wrapper.method).parameters) == ["self", "x"]
    assert Wrapper().method(4) == "4"


def test_bad_choice_names_the_parameter():
    with pytest.raises(ValueError, match="handle_first_dst_param must be one of"):
        copy_signature(target, handle_first_dst_param="keep")


def test_not_none_and_apply_module():
    assert not_none(0) == 0
    with pytest.raises(ValueError, match="Expected value to be not None"):
        not_none(None)
    layer = torch.nn.Linear(2, 2)
    assert apply_module(layer) is layer
    with pytest.raises(TypeError, match="not a subclass of torch.nn.Module"):
        apply_module(object())
