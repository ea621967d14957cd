"""The chunked SSD scan equals the step-by-step recurrence: outputs, final state and every input's gradient.

The reference (``ssd_reference.sequential_ssd``) runs in float64 on the same inputs; chunk sizes include 1, sizes that
do not divide the sequence and a size longer than it. Negative controls show the comparison has teeth: dropping
``D`` or the state carried between steps moves the output far outside the tolerance.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.ssd_chunked import segsum, ssd_chunked_scan
from tests.unit_tests.ssm.ssd_reference import sequential_ssd

BATCH, SEQLEN, NHEADS, HEADDIM, NGROUPS, DSTATE = 2, 23, 4, 3, 2, 5


def _inputs(seed=0, d_has_hdim=False):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return dict(
        x=randn(BATCH, SEQLEN, NHEADS, HEADDIM),
        dt=F.softplus(randn(BATCH, SEQLEN, NHEADS) - 1.0),
        A=-torch.rand(NHEADS, generator=generator, dtype=torch.float64) * 3 - 0.1,
        B=randn(BATCH, SEQLEN, NGROUPS, DSTATE),
        C=randn(BATCH, SEQLEN, NGROUPS, DSTATE),
        D=randn(NHEADS, HEADDIM) if d_has_hdim else randn(NHEADS),
    )


def _as(inputs, dtype, requires_grad=False):
    return {k: v.to(dtype).detach().requires_grad_(requires_grad) for k, v in inputs.items()}


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 8, 23, 64])
@pytest.mark.parametrize("d_has_hdim", [False, True])
def test_chunked_equals_sequential_fp32_forward_and_gradients(chunk_size, d_has_hdim):
    inputs = _inputs(d_has_hdim=d_has_hdim)
    reference = _as(inputs, torch.float64, requires_grad=True)
    y_ref, state_ref = sequential_ssd(**reference)
    ours = _as(inputs, torch.float32, requires_grad=True)
    y, state = ssd_chunked_scan(
        **{k: ours[k] for k in "x dt A B C".split()}, chunk_size=chunk_size, D=ours["D"], return_final_states=True
    )
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    assert _max_rel(y, y_ref) < 1e-5
    assert _max_rel(state, state_ref) < 1e-5

    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ((y_ref * upstream).sum() + state_ref.sum()).backward()
    ((y * upstream.float()).sum() + state.sum()).backward()
    for name in inputs:
        assert _max_rel(ours[name].grad, reference[name].grad) < 1e-5, name


@pytest.mark.parametrize("chunk_size", [4, 7])
def test_chunked_equals_sequential_bf16_inputs(chunk_size):
    # bf16 inputs are computed in fp32 and rounded once at the output; the reference sees the same rounded inputs.
    inputs = _as(_as(_inputs(seed=2), torch.bfloat16), torch.float64)
    y_ref, _ = sequential_ssd(**inputs)
    bf16 = _as(inputs, torch.bfloat16, requires_grad=True)
    y = ssd_chunked_scan(**{k: bf16[k] for k in "x dt A B C".split()}, chunk_size=chunk_size, D=bf16["D"])
    assert y.dtype == torch.bfloat16
    assert _max_rel(y, y_ref) < 1e-2
    reference = _as(inputs, torch.float64, requires_grad=True)
    sequential_ssd(**reference)[0].sum().backward()
    y.float().sum().backward()
    for name in inputs:
        assert bf16[name].grad.dtype == torch.bfloat16
        assert _max_rel(bf16[name].grad, reference[name].grad) < 3e-2, name


def test_dt_bias_softplus_gate_and_initial_state():
    inputs = _inputs(seed=3)
    dt_raw = torch.randn(BATCH, SEQLEN, NHEADS, dtype=torch.float64)
    dt_bias = torch.randn(NHEADS, dtype=torch.float64)
    z = torch.randn(BATCH, SEQLEN, NHEADS, HEADDIM, dtype=torch.float64)
    initial = torch.randn(BATCH, NHEADS, HEADDIM, DSTATE, dtype=torch.float64)
    y_ref, state_ref = sequential_ssd(**{**inputs, "dt": F.softplus(dt_raw + dt_bias)}, initial_state=initial)
    y_ref = y_ref * F.silu(z)
    y, state = ssd_chunked_scan(
        inputs["x"],
        dt_raw,
        inputs["A"],
        inputs["B"],
        inputs["C"],
        6,
        D=inputs["D"],
        z=z,
        dt_bias=dt_bias,
        initial_states=initial,
        dt_softplus=True,
        return_final_states=True,
    )
    assert _max_rel(y, y_ref) < 1e-10
    assert _max_rel(state, state_ref) < 1e-10


def test_negative_controls_dropping_d_or_the_state_changes_the_output():
    inputs = _as(_inputs(seed=4), torch.float32)
    args = {k: inputs[k] for k in "x dt A B C".split()}
    y_ref, _ = sequential_ssd(**_as(inputs, torch.float64))
    with_d = ssd_chunked_scan(**args, chunk_size=8, D=inputs["D"])
    without_d = ssd_chunked_scan(**args, chunk_size=8)
    assert _max_rel(with_d, y_ref) < 1e-5
    assert _max_rel(without_d, y_ref) > 1e-2
    # No state carried between steps: every step sees only its own input (exp(dt A) -> 0 kills the memory).
    memoryless = ssd_chunked_scan(**{**args, "A": torch.full_like(inputs["A"], -1e4)}, chunk_size=8, D=inputs["D"])
    assert _max_rel(memoryless, y_ref) > 1e-2
    # No state passed between chunks: chunk size 8 then differs from the full recurrence.
    per_chunk = torch.cat(
        [
            ssd_chunked_scan(
                **{k: v[:, s : s + 8] if k != "A" else v for k, v in args.items()}, chunk_size=8, D=inputs["D"]
            )
            for s in range(0, SEQLEN, 8)
        ],
        dim=1,
    )
    assert _max_rel(per_chunk, y_ref) > 1e-2


def test_states_dtype_rounds_the_passed_states():
    inputs = _as(_inputs(seed=5), torch.float32)
    args = {k: inputs[k] for k in "x dt A B C".split()}
    fp32 = ssd_chunked_scan(**args, chunk_size=4)
    rounded = ssd_chunked_scan(**args, chunk_size=4, states_dtype=torch.bfloat16)
    assert 0 < _max_rel(rounded, fp32) < 2e-2


def test_segsum_is_the_sum_over_the_segment():
    a = torch.randn(6, dtype=torch.float64)
    out = segsum(a)
    for i in range(6):
        for j in range(6):
            expected = a[j + 1 : i + 1].sum() if i >= j else torch.tensor(float("-inf"), dtype=torch.float64)
            assert torch.allclose(out[i, j], expected), (i, j)


def test_bad_shapes_are_refused_with_the_argument_named():
    inputs = _as(_inputs(), torch.float32)
    args = {k: inputs[k] for k in "x dt A B C".split()}
    with pytest.raises(ValueError, match=r"dt must be \(2, 23, 4\)"):
        ssd_chunked_scan(**{**args, "dt": args["dt"][:, :5]}, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        ssd_chunked_scan(**args, chunk_size=0)
    with pytest.raises(ValueError, match=r"nheads \(4\) must be a multiple of ngroups \(3\)"):
        ssd_chunked_scan(**{**args, "B": torch.zeros(2, 23, 3, 5), "C": torch.zeros(2, 23, 3, 5)}, chunk_size=4)
    with pytest.raises(ValueError, match=r"D must be \[nheads\] or \[nheads, headdim\]"):
        ssd_chunked_scan(**args, chunk_size=4, D=torch.ones(5))
