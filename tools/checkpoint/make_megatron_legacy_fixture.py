"""Write the legacy (``--ckpt-format torch``) checkpoint fixture with Megatron-LM itself.

The fixture under ``tests/unit_tests/dist_checkpointing/data/megatron_legacy_torch/`` is what Megatron-LM's own
``megatron.training.checkpointing.save_checkpoint`` writes for a 2-layer GPTModel (local spec, hidden size 16, 4
heads, vocabulary 32, sequence length 8) after one Adam step over Megatron-LM's parameter groups, at iteration 1
with 123.0 floating-point operations so far: ``iter_0000001/mp_rank_00/model_optim_rng.pt`` and the tracker file.
The tests load it into this project's model and compare every tensor with the file.

Run it with a Python environment that has Megatron-LM's dependencies, from outside this repository::

    python tools/checkpoint/make_megatron_legacy_fixture.py /path/to/Megatron-LM OUTPUT_DIR

Megatron-LM needs a GPU for a few things this script sidesteps on a CPU-only machine: the CUDA RNG state is
replaced by the CPU generator's state, and FP32Optimizer's loss-scale tensor is placed on the CPU. Neither changes
the checkpoint's layout. Megatron-LM 0.19 also uses ``typing.override`` (Python 3.12); on 3.11 a no-op stands in.
"""

import os
import sys
import typing


def main(megatron_root: str, output_dir: str) -> None:
    sys.path.insert(0, megatron_root)
    typing.override = getattr(typing, "override", lambda function: function)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

    import torch

    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # no CUDA generator on a CPU

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups, get_standard_config_overrides
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_args
    from megatron.training.training import get_optimizer_param_scheduler

    flags = (
        "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
        "--vocab-size 32 --micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --train-iters 1 --save-interval 1 "
        "--ckpt-format torch --tokenizer-type NullTokenizer --transformer-impl local --mock-data "
        "--use-cpu-initialization --no-gradient-accumulation-fusion --no-persist-layer-norm "
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion"
    )
    sys.argv = ["make_megatron_legacy_fixture", *flags.split(), "--save", output_dir]
    args = parse_args()
    torch.distributed.init_process_group("gloo")
    validate_args(args)
    set_args(args)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model = GPTModel(
        core_transformer_config_from_args(args), get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8
    )
    config = OptimizerConfig(lr=1e-3, min_lr=0.0, weight_decay=0.01)
    # Megatron-LM's own parameter groups (no weight decay on biases and norms), as get_megatron_optimizer builds.
    adam = torch.optim.Adam(_get_param_groups([model], config, get_standard_config_overrides(config)), lr=1e-3)
    create_tensor = torch.tensor
    torch.tensor = lambda *a, **k: create_tensor(*a, **({**k, "device": "cpu"} if k.get("device") == "cuda" else k))
    try:
        optimizer = FP32Optimizer(adam, config, None)
    finally:
        torch.tensor = create_tensor
    for index, parameter in enumerate(model.parameters()):
        parameter.grad = torch.full_like(parameter, 0.01 * (index + 1))
    adam.step()  # Adam's moments and step are in the checkpoint
    save_checkpoint(1, [model], optimizer, get_optimizer_param_scheduler(optimizer), 123.0)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} MEGATRON_LM_ROOT OUTPUT_DIR")
    main(sys.argv[1], sys.argv[2])
