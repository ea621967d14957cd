"""The output layer's deferred weight gradients (``defer_embedding_wgrad_compute``): the pipeline schedule buffers
the last stage's inputs and output gradients, and :func:`drain_embedding_wgrad_compute` computes the weight gradient
from them later, overlapped with other work. Megatron lists both functions in ``megatron.core.utils``."""

from megatron.core.fusions.fused_weight_gradient import wgrad_gemm_accum
from megatron.core.public_api import public_api
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


@public_api("megatron.core.utils")
def prepare_input_tensors_for_wgrad_compute(grad_output, all_gathered_input):
    """Flatten ``[s, b, h]`` gradients and inputs to 2-D ``[s*b, h]`` for the weight-gradient GEMM."""
    grad_output = grad_output.contiguous()
    grad_output = grad_output.view(-1, grad_output.shape[-1])
    all_gathered_input = all_gathered_input.contiguous()
    all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[-1])
    return grad_output, all_gathered_input


@public_api("megatron.core.utils")
def drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """Compute the output-layer weight gradients that ``defer_embedding_wgrad_compute`` postponed, and empty the
    buffers.

    Each buffered input is gathered over ``tp_group`` first when sequence parallelism split it; the gradient is
    accumulated into ``weight.main_grad`` with gradient-accumulation fusion, else into ``weight.grad``.
    """
    while embedding_activation_buffer:
        activation = embedding_activation_buffer.pop(0)
        grad_output = grad_output_buffer.pop(0)
        if config.sequence_parallel:
            activation = gather_from_sequence_parallel_region(
                activation, tensor_parallel_output_grad=False, group=tp_group
            )
        grad_output, activation = prepare_input_tensors_for_wgrad_compute(grad_output, activation)
        if config.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
            wgrad_gemm_accum(activation, grad_output, weight.main_grad)
            continue
        grad_weight = grad_output.t().matmul(activation.to(grad_output.dtype))
        if weight.grad is None:
            weight.grad = grad_weight.to(weight.dtype)
        else:
            weight.grad.add_(grad_weight.to(weight.grad.dtype))
    grad_output_buffer.clear()
