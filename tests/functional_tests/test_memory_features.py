"""The memory-saving features through pretrain_gpt.py: optimizer CPU offload and activation offloading train like
the single-process reference (the same fp32 model, the same batches), and the precision-aware optimizer with bf16
moments trains a bf16 model to the same losses within bf16 rounding.

Offloading moves tensors between memories and changes no arithmetic (on a CPU-only machine both sides are host
memory), so those runs meet the reference within the layout tests' fp32 bound. The precision-aware run is a bf16
model, compared with a bf16 run of the plain distributed optimizer."""

from tests.functional_tests.configs import EQUIVALENCE_FLAGS, EQUIVALENCE_ITERS, with_flag
from tests.functional_tests.harness import assert_curves_close, run_pretrain
from tests.functional_tests.test_layout_equivalence import assert_trains_like_reference

# One loss per iteration; 16-bit moments perturb a bf16 model's loss far below this over 10 iterations.
BF16_LOSS_REL_TOL = 1e-2


def _flags(*extra) -> list:
    return with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_ITERS)) + list(extra)


def test_optimizer_cpu_offload_trains_like_one_process(equivalence_reference, cpu_data_flags):
    offload = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
    result = run_pretrain(_flags(*offload) + cpu_data_flags, nproc=2)
    assert_trains_like_reference(result, equivalence_reference, "DP2, distributed optimizer, half offloaded")


def test_layer_activation_offloading_trains_like_one_process(equivalence_reference, cpu_data_flags):
    result = run_pretrain(_flags("--cpu-offloading-num-layers", "2") + cpu_data_flags)
    assert_trains_like_reference(result, equivalence_reference, "--cpu-offloading-num-layers 2")


def test_fine_grained_activation_offloading_trains_like_one_process(equivalence_reference, cpu_data_flags):
    fine_grained = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj"]
    result = run_pretrain(_flags(*fine_grained, "--min-offloaded-tensor-size", "0") + cpu_data_flags)
    assert_trains_like_reference(result, equivalence_reference, "fine-grained offloading of core_attn, attn_proj")


def test_precision_aware_optimizer_trains_like_the_plain_one_within_bf16(cpu_data_flags):
    bf16 = ["--bf16", "--use-distributed-optimizer"]
    plain = run_pretrain(_flags(*bf16) + cpu_data_flags, nproc=2)
    aware = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    result = run_pretrain(_flags(*bf16, *aware, "--main-grads-dtype", "bf16") + cpu_data_flags, nproc=2)
    assert len(result.curve()) == EQUIVALENCE_ITERS
    assert_curves_close(result.curve(), plain.curve(), BF16_LOSS_REL_TOL, f"precision-aware\n{result.describe()}")
