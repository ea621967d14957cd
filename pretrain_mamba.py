"""Pretrain a Mamba / hybrid model under Megatron-LM's earlier entry-point name: pretrain_hybrid.py with the model
built as ``MambaModel`` (``mamba_stack_spec``, or ``--spec <module> <name>``). Same flags as pretrain_hybrid.py."""

import pretrain_gpt
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.models.mamba.mamba_model import MambaModel
from pretrain_hybrid import build_hybrid_model, hybrid_model_flags


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage=None, config=None, pg_collection=None
) -> MambaModel:
    """A MambaModel for this pipeline stage."""
    return build_hybrid_model(
        MambaModel, "mamba_stack_spec", mamba_stack_spec, pre_process, post_process, vp_stage, config, pg_collection
    )


if __name__ == "__main__":
    from functools import partial

    from megatron.training.error_handling import tool_main

    tool_main(partial(pretrain_gpt.main, model_provider_func=model_provider, extra_args_provider=hybrid_model_flags))
