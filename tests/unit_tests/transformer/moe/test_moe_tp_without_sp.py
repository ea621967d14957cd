"""MoE layers under tensor parallelism without sequence parallelism, as Megatron-Core allows them: the config is
accepted, evaluation gives the single-process output (every TP rank holds and routes the whole sequence), the same
as with sequence parallelism, for both dispatchers and with experts split over TP or over EP; training is refused
with the flag that fixes it."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.test_utilities import Utils, run_distributed
from tests.unit_tests.transformer.moe.moe_test_helpers import build_moe_layer, fresh_moe_state, global_batch, moe_config

TOLERANCE = 1e-5


def _eval_output(tp: int, ep: int, etp: int, sequence_parallel: bool, dispatcher: str) -> torch.Tensor:
    """The layer's output for the whole test sequence (gathered over TP under sequence parallelism), in eval."""
    Utils.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    fresh_moe_state()
    config = moe_config(tp, ep, etp, sequence_parallel=sequence_parallel, moe_token_dispatcher_type=dispatcher)
    layer = build_moe_layer(config).eval()
    (x,), _ = global_batch(1)
    if sequence_parallel:
        x = x.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    with torch.no_grad():
        output, _ = layer(x)
    if sequence_parallel:
        pieces = [torch.empty_like(output) for _ in range(tp)]
        dist.all_gather(pieces, output, group=parallel_state.get_tensor_model_parallel_group())
        output = torch.cat(pieces)
    return output


LAYOUTS = [
    # tp, ep, etp: experts split over the TP ranks (ETP = TP), spread over them (EP inside the TP group), or whole
    (2, 1, 2),
    (2, 2, 1),
    (2, 1, 1),
]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("tp,ep,etp", LAYOUTS, ids=[f"tp{t}-ep{e}-etp{x}" for t, e, x in LAYOUTS])
def test_eval_without_sequence_parallel_matches_one_process_and_sequence_parallel(tp, ep, etp, dispatcher):
    (expected,) = run_distributed(1, _eval_output, 1, 1, 1, False, dispatcher)
    without_sp = run_distributed(2, _eval_output, tp, ep, etp, False, dispatcher)
    with_sp = run_distributed(2, _eval_output, tp, ep, etp, True, dispatcher)
    for output in without_sp + with_sp:
        assert output.shape == expected.shape
        assert relative_error(output, expected) <= TOLERANCE


def _train_forward():
    Utils.initialize_model_parallel(2)
    fresh_moe_state()
    layer = build_moe_layer(moe_config(2, sequence_parallel=False))
    (x,), _ = global_batch(1)
    with pytest.raises(ValueError) as raised:
        layer(x)
    return str(raised.value)


def test_training_without_sequence_parallel_is_refused_with_the_fix():
    for message in run_distributed(2, _train_forward):
        assert message == (
            "MoELayer: training with tensor_model_parallel_size=2 needs sequence parallelism; set "
            "sequence_parallel=True (--sequence-parallel), or call model.eval() to evaluate or generate without it"
        )
