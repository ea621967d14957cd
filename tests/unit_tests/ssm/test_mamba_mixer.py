"""MambaMixer: equal to its definition computed by hand, the same model at TP 1 / 2 / 4 (and with sequence
parallelism), and every bad size refused with a message."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_rmsnorm import GatedRMSNorm
from megatron.core.ssm.mamba_mixer import mamba_mixer_sizes
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.ssm import mamba_test_helpers as helpers
from tests.unit_tests.ssm.ssd_reference import sequential_ssd
from tests.unit_tests.test_utilities import run_distributed

CHUNK = 5  # does not divide SEQ = 12


def _inputs():
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(helpers.SEQ, helpers.BATCH, helpers.HIDDEN, generator=generator)
    upstream = torch.randn(helpers.SEQ, helpers.BATCH, helpers.HIDDEN, generator=generator)
    return x, upstream


def _perturb(module, seed):
    """Move the parameters that start as ones / zeros (D, norm, biases) away from them, so every term shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))


# ---- the mixer equals its definition --------------------------------------------------------------------------


def _reference_mixer(params, x, mixer):
    """in_proj -> causal depthwise conv + SiLU -> step-by-step SSD -> gated group RMSNorm -> out_proj, by hand."""
    d_inner, nheads, ngroups = mixer.d_inner, mixer.nheads, mixer.ngroups
    d_state, headdim = mixer.d_state, mixer.headdim
    seqlen, batch, _ = x.shape
    zxbcdt = x.transpose(0, 1) @ params["in_proj.weight"].T  # [b, s, d]
    z, xBC, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * ngroups * d_state, nheads], dim=-1)
    weight, bias, width = params["conv1d.weight"][:, 0], params["conv1d.bias"], mixer.d_conv
    conv = torch.stack(
        [
            bias + sum(weight[:, k] * xBC[:, t + k - (width - 1)] for k in range(width) if t + k - (width - 1) >= 0)
            for t in range(seqlen)
        ],
        dim=1,
    )
    xBC = F.silu(conv)
    xs, B, C = torch.split(xBC, [d_inner, ngroups * d_state, ngroups * d_state], dim=-1)
    D = params["D"].view(nheads, headdim) if mixer.D_has_hdim else params["D"]
    y, _ = sequential_ssd(
        xs.reshape(batch, seqlen, nheads, headdim),
        F.softplus(dt + params["dt_bias"]),
        -torch.exp(params["A_log"]),
        B.reshape(batch, seqlen, ngroups, d_state),
        C.reshape(batch, seqlen, ngroups, d_state),
        D,
    )
    y = y.reshape(batch, seqlen, d_inner)
    gate = F.silu(z)
    if not mixer.norm_before_gate:
        y = y * gate
    groups = y.reshape(batch, seqlen, ngroups, -1)
    y = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape_as(y) * params["norm.weight"]
    if mixer.norm_before_gate:
        y = y * gate
    return (y @ params["out_proj.weight"].T).transpose(0, 1)


def _mixer_against_definition(mixer_params):
    mixer = helpers.build_mixer(1, seed=7, chunk_size=CHUNK, **mixer_params)
    _perturb(mixer, seed=8)
    x, upstream = _inputs()
    x.requires_grad_(True)
    out, bias = mixer(x)
    (out * upstream).sum().backward()
    params = {name: p.detach().double().requires_grad_(True) for name, p in mixer.named_parameters()}
    x_ref = x.detach().double().requires_grad_(True)
    ref = _reference_mixer(params, x_ref, mixer)
    (ref * upstream.double()).sum().backward()

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    errors = {"output": rel(out, ref), "input grad": rel(x.grad, x_ref.grad)}
    errors.update({name: rel(p.grad, params[name].grad) for name, p in mixer.named_parameters()})
    return bias is None, errors


@pytest.mark.parametrize("mixer_params", [{}, {"norm_before_gate": True, "D_has_hdim": True}])
def test_mixer_equals_its_definition_forward_and_gradients(mixer_params):
    no_bias, errors = run_distributed(1, _mixer_against_definition, mixer_params)[0]
    assert no_bias
    assert max(errors.values()) < 1e-5, errors


# ---- tensor parallelism ---------------------------------------------------------------------------------------


def _mixer_run(tp, sequence_parallel):
    overrides = {"sequence_parallel": sequence_parallel}
    mixer = helpers.build_mixer(tp, seed=11, config_overrides=overrides, chunk_size=CHUNK, bias=True)
    initial = helpers.whole_parameters(mixer)
    x, upstream = _inputs()
    if sequence_parallel:
        local = helpers.SEQ // tp
        rank = mixer.tp_rank
        x, upstream = x[rank * local : (rank + 1) * local], upstream[rank * local : (rank + 1) * local]
    x = x.clone().requires_grad_(True)
    out, bias = mixer(x)
    out = out + bias
    (out * upstream).sum().backward()
    if sequence_parallel:
        # Partial gradients of parameters that see this rank's sequence slice are summed over TP by
        # finalize_model_grads; out_proj's bias is one of them.
        for param in mixer.parameters():
            if getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(param.grad, group=mixer.tp_group)
    grads = helpers.whole_parameters(mixer, grads=True)
    if sequence_parallel:
        out = torch.cat(helpers._gather(out.detach()), dim=0)
        x_grad = torch.cat(helpers._gather(x.grad), dim=0)
    else:
        x_grad = x.grad
    return {"init": initial, "out": out.detach(), "x_grad": x_grad, "grads": grads}


@pytest.fixture(scope="module")
def tp1_run():
    return run_distributed(1, _mixer_run, 1, False)[0]


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (4, False), (2, True)])
def test_tensor_parallel_mixer_equals_tp1(tp1_run, tp, sequence_parallel):
    results = run_distributed(tp, _mixer_run, tp, sequence_parallel)
    for result in results:
        for name, value in tp1_run["init"].items():
            assert torch.equal(result["init"][name], value), f"initial {name} differs at TP={tp}"
        torch.testing.assert_close(result["out"], tp1_run["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["x_grad"], tp1_run["x_grad"], rtol=1e-5, atol=1e-6)
        for name, value in tp1_run["grads"].items():
            torch.testing.assert_close(result["grads"][name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- the gated norm --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rmsnorm_normalises_each_group_separately(norm_before_gate):
    norm = GatedRMSNorm(8, eps=1e-5, group_size=4, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    y, z = torch.randn(3, 8), torch.randn(3, 8)
    gated = y * F.silu(z) if not norm_before_gate else y
    expected = torch.cat([g / g.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() for g in gated.split(4, -1)], -1)
    expected = expected * norm.weight
    if norm_before_gate:
        expected = expected * F.silu(z)
    torch.testing.assert_close(norm(y, z), expected)
    # One group over all 8 channels is a different norm.
    whole = GatedRMSNorm(8, group_size=8, norm_before_gate=norm_before_gate)
    assert not torch.allclose(whole(y, z) * norm.weight, norm(y, z))
    with pytest.raises(ValueError, match=r"hidden_size \(8\) must be a positive multiple of group_size \(3\)"):
        GatedRMSNorm(8, group_size=3)


# ---- bad sizes and arguments -----------------------------------------------------------------------------------


def _config(**overrides):
    return TransformerConfig(**{**dict(num_layers=1, hidden_size=16, num_attention_heads=4), **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(mamba_state_dim=0), "mamba_state_dim must be a positive integer, got 0"),
        (dict(mamba_head_dim=-4), "mamba_head_dim must be a positive integer, got -4"),
        (dict(mamba_num_groups=2.5), "mamba_num_groups must be a positive integer, got 2.5"),
        (dict(mamba_num_heads=0), "mamba_num_heads must be a positive integer or None, got 0"),
        (
            dict(mamba_num_groups=4, mamba_num_heads=6),
            r"mamba_num_heads \(6\) must be a multiple of mamba_num_groups \(4\)",
        ),
        (
            dict(mamba_num_groups=2, mamba_num_heads=6, tensor_model_parallel_size=4),
            r"mamba_num_heads \(6\) must be divisible by tensor_model_parallel_size \(4\)",
        ),
        (
            dict(is_hybrid_model=True, mamba_num_groups=2, tensor_model_parallel_size=4),
            r"mamba_num_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)",
        ),
        (
            dict(mamba_training_ssm_states_dtype=torch.float16),
            "mamba_training_ssm_states_dtype=torch.float16 is not supported",
        ),
    ],
)
def test_config_refuses_bad_mamba_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_config_accepts_mamba_fields_and_leaves_gpt_configs_alone():
    config = _config(
        is_hybrid_model=True,
        mamba_num_groups=2,
        mamba_num_heads=8,
        use_mamba_mem_eff_path=False,
        mamba_training_ssm_states_dtype=torch.bfloat16,
    )
    assert config.mamba_num_heads == 8
    # Default groups (8) need not divide TP in a model without Mamba layers.
    assert _config(tensor_model_parallel_size=16, num_attention_heads=16).mamba_num_groups == 8


@pytest.mark.parametrize(
    "overrides,d_model,expand,tp,message",
    [
        (
            dict(mamba_head_dim=6, mamba_num_groups=1),
            16,
            2,
            1,
            r"d_inner = expand \* d_model = 2 \* 16 = 32 is not divisible by mamba_head_dim \(6\)",
        ),
        (
            dict(mamba_head_dim=4, mamba_num_groups=3),
            16,
            2,
            1,
            r"number of heads \(8\) must be a multiple of mamba_num_groups \(3\)",
        ),
        (
            dict(mamba_head_dim=8, mamba_num_groups=1),
            16,
            2,
            8,
            r"heads \(4\) must be divisible by the tensor-parallel size \(8\)",
        ),
        (
            dict(mamba_head_dim=2, mamba_num_groups=2),
            16,
            2,
            4,
            r"mamba_num_groups \(2\) must be divisible by the tensor-parallel size \(4\)",
        ),
        (dict(mamba_head_dim=4), 16, 0, 1, "expand must be a positive integer, got 0"),
    ],
)
def test_mixer_sizes_refused(overrides, d_model, expand, tp, message):
    with pytest.raises(ValueError, match=message):
        mamba_mixer_sizes(_config(**overrides), d_model, expand, tp)


def test_mixer_sizes_from_num_heads():
    assert mamba_mixer_sizes(_config(mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=6), 16, 2, 2) == (24, 6)


def _mixer_argument_errors():
    cases = [
        (dict(A_init_range=(0, 16)), "A_init_range must satisfy 0 < low <= high, got (0, 16)"),
        (dict(dt_min=0.2, dt_max=0.1), "dt_min and dt_max must satisfy 0 < dt_min <= dt_max, got 0.2, 0.1"),
        (dict(dt_init_floor=-1.0), "dt_init_floor must be >= 0, got -1.0"),
        (dict(d_conv=0), "d_conv must be a positive integer, got 0"),
        (dict(chunk_size=0), "chunk_size must be a positive integer, got 0"),
    ]
    messages = []
    for params, expected in cases:
        try:
            helpers.build_mixer(1, seed=0, **params)
            messages.append((expected, "no error"))
        except ValueError as error:
            messages.append((expected, str(error)))
    config = helpers.config()
    config.context_parallel_size = 2
    try:
        helpers.MambaMixer(config, helpers.MIXER_SUBMODULES, d_model=helpers.HIDDEN)
        messages.append(("context_parallel_size=2 is not supported", "no error"))
    except ValueError as error:
        messages.append(("context_parallel_size=2 is not supported", str(error)))
    mixer = helpers.build_mixer(1, seed=0)
    x = torch.zeros(helpers.SEQ, helpers.BATCH, helpers.HIDDEN)
    # inference_context misuse is checked in test_mamba_inference.py.
    for kwargs, expected in (
        (dict(packed_seq_params=object()), "packed sequences (packed_seq_params)"),
        (dict(packed_seq_params=object(), inference_context=object()), "packed sequences (packed_seq_params)"),
    ):
        try:
            mixer(x, **kwargs)
            messages.append((expected, "no error"))
        except ValueError as error:
            messages.append((expected, str(error)))
    return messages


def test_mixer_refuses_bad_arguments_and_unsupported_inputs():
    for expected, message in run_distributed(1, _mixer_argument_errors)[0]:
        assert expected in message and message.startswith("MambaMixer: "), (expected, message)


# ---- initialisation ----------------------------------------------------------------------------------------------


def _initial_values(use_cpu_initialization):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    overrides = {"use_cpu_initialization": use_cpu_initialization}
    helpers.Utils.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    mixer = helpers.MambaMixer(
        helpers.config(**overrides),
        helpers.MIXER_SUBMODULES,
        d_model=helpers.HIDDEN,
        A_init_range=(2, 4),
        dt_min=0.01,
        dt_max=0.05,
        dt_init_floor=0.02,
        conv_init=0.3,
    )
    return {name: param.detach().clone() for name, param in mixer.named_parameters()}


@pytest.mark.parametrize("use_cpu_initialization", [True, False])
def test_initial_values_follow_the_mamba2_init(use_cpu_initialization):
    params = run_distributed(1, _initial_values, use_cpu_initialization)[0]
    A = torch.exp(params["A_log"])
    assert params["A_log"].dtype == torch.float32 and ((A >= 2) & (A <= 4)).all()
    dt = F.softplus(params["dt_bias"])
    torch.testing.assert_close(dt.clamp(0.02, 0.05), dt)  # drawn in [0.01, 0.05], floored at 0.02
    assert (dt > 0.02).any()
    assert torch.equal(params["D"], torch.ones(8)) and torch.equal(params["norm.weight"], torch.ones(32))
    assert params["conv1d.weight"].abs().max() <= 0.3 and params["conv1d.weight"].std() > 0.05
    assert params["conv1d.bias"].abs().max() <= 0.5  # 1 / sqrt(d_conv = 4)
    assert len(set(params["A_log"].tolist())) == 8, "heads drew the same A"


# ---- mamba-ssm's kernels (GPU machines with mamba-ssm installed) ---------------------------------------------------


def _kernel_paths_against_pytorch():
    from megatron.core.ssm import ssd_kernels

    mixer = helpers.build_mixer(1, seed=7, chunk_size=CHUNK)
    _perturb(mixer, seed=8)
    x, upstream = (t.cuda() for t in _inputs())

    def run(use_mem_eff_path, kernels):
        mixer.use_mem_eff_path = use_mem_eff_path
        saved = ssd_kernels.kernels_usable, ssd_kernels.conv1d_kernel_usable
        if not kernels:
            ssd_kernels.kernels_usable = ssd_kernels.conv1d_kernel_usable = lambda tensor=None: False
        try:
            inputs = x.clone().requires_grad_(True)
            out, _ = mixer(inputs)
            (out * upstream).sum().backward()
        finally:
            ssd_kernels.kernels_usable, ssd_kernels.conv1d_kernel_usable = saved
        grads = {name: p.grad.cpu() for name, p in mixer.named_parameters()}
        mixer.zero_grad(set_to_none=True)
        return out.detach().cpu(), inputs.grad.cpu(), grads

    reference = run(False, kernels=False)
    return {path: [reference, run(path == "fused", kernels=True)] for path in ("fused", "separate")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mamba_ssm_kernels_match_the_pytorch_path():
    pytest.importorskip("mamba_ssm")
    for path, (reference, kernel) in run_distributed(1, _kernel_paths_against_pytorch)[0].items():
        torch.testing.assert_close(kernel[0], reference[0], rtol=1e-3, atol=1e-4, msg=f"{path}: output")
        torch.testing.assert_close(kernel[1], reference[1], rtol=1e-3, atol=1e-4, msg=f"{path}: input grad")
        for name, grad in reference[2].items():
            torch.testing.assert_close(kernel[2][name], grad, rtol=1e-3, atol=1e-4, msg=f"{path}: {name}")


def _bf16_against_fp32():
    mixer = helpers.build_mixer(1, seed=7, chunk_size=CHUNK)
    _perturb(mixer, seed=8)
    x, upstream = _inputs()
    fp32_out, _ = mixer(x)
    fp32_grad = torch.autograd.grad((fp32_out * upstream).sum(), mixer.in_proj.weight)[0]
    mixer.to(torch.bfloat16)
    bf16_out, _ = mixer(x.bfloat16())
    bf16_grad = torch.autograd.grad((bf16_out.float() * upstream).sum(), mixer.in_proj.weight)[0]
    return fp32_out.detach(), bf16_out.detach(), fp32_grad, bf16_grad


def test_bf16_mixer_stays_close_to_fp32():
    fp32_out, bf16_out, fp32_grad, bf16_grad = run_distributed(1, _bf16_against_fp32)[0]
    assert bf16_out.dtype == torch.bfloat16 and bf16_grad.dtype == torch.bfloat16
    for ours, reference in ((bf16_out, fp32_out), (bf16_grad, fp32_grad)):
        assert ((ours.float() - reference).abs().max() / reference.abs().max()).item() < 3e-2
