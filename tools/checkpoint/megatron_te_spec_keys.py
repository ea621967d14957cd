"""Write the checkpoint keys of Megatron-Core's own Transformer Engine layer spec, for the golden-key test.

Run it with a Python that has Megatron-Core (not this project) importable, from outside this repository, e.g.::

    cd /tmp && /tmp/mvenv/bin/python /path/to/repo/tools/checkpoint/megatron_te_spec_keys.py \\
        --megatron /tmp/mlm --output /path/to/repo/tests/unit_tests/dist_checkpointing/golden_gpt_te_spec_keys.txt

Megatron's Transformer Engine wrappers subclass Transformer Engine's modules, which need a GPU build. A stand-in
``transformer_engine`` package is installed for the run: its modules only create Transformer Engine's parameters
under Transformer Engine's names (``Linear``: ``weight``, ``bias``; ``LayerNormLinear``: ``layer_norm_weight``,
``layer_norm_bias`` for LayerNorm, ``weight``, ``bias``; ``GroupedLinear``: ``weight<i>``, ``bias<i>``;
``LayerNorm`` / ``RMSNorm``: ``weight`` (``bias``); ``DotProductAttention``: none) with TP-split shapes, and the
extra state Transformer Engine 2.x returns without FP8 (``torch.empty(0, dtype=torch.uint8)``, from modules and
ops alike). Everything else is Megatron's: which module each spec slot gets, the key maps, ``sharded_state_dict``
of every wrapper (TP axes, ShardedObjects for ``_extra_state``, core attention left out, grouped experts, the
block's stacked layer axis). Each model is built on 2 gloo ranks (TP=2), so each key's sharding is recorded too:
``split=<axis>`` (the axis the TP ranks' pieces differ on) or ``replicated`` (one main replica).
"""

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import torch
import torch.multiprocessing as mp
from torch.nn import Parameter

# Each section: name -> (TransformerConfig fields, GPTModel keyword arguments, layer-spec keyword arguments).
# "activation_func" is the name of a torch.nn.functional function. The test builds the same models from these.
MODELS = {
    "gpt: LayerNorm, GELU, biases, learned absolute positions, untied output layer": (
        {"add_bias_linear": True},
        {"position_embedding_type": "learned_absolute", "share_embeddings_and_output_weights": False},
        {},
    ),
    "llama: RMSNorm, SwiGLU, grouped-query attention, no biases, rotary positions, tied output layer": (
        {
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "activation_func": "silu",
            "num_query_groups": 4,
            "add_bias_linear": False,
        },
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": True},
        {},
    ),
    "qk_layernorm: LayerNorm on query and key heads, QKV bias only": (
        {"qk_layernorm": True, "add_bias_linear": False, "add_qkv_bias": True},
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
        {"qk_layernorm": True},
    ),
    "moe grouped gemm: 4 experts as grouped linears, SwiGLU, shared expert, RMSNorm": (
        {
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "activation_func": "silu",
            "add_bias_linear": False,
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "moe_grouped_gemm": True,
        },
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
        {"num_experts": 4, "moe_grouped_gemm": True},
    ),
    "moe sequential: 4 experts as separate MLPs, GELU, LayerNorm": (
        {"add_bias_linear": False, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32},
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
        {"num_experts": 4, "moe_grouped_gemm": False},
    ),
}
BASE_CONFIG = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "ffn_hidden_size": 128,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "use_cpu_initialization": True,
}
VOCAB, SEQ, TP = 128, 16, 2
STAND_IN_TE_VERSION = "2.8.0"


# ---- the stand-in transformer_engine package ----------------------------------------------------------------------


class _TEModule(torch.nn.Module):
    """What every Transformer Engine module and op shares here: empty extra state when FP8 is off."""

    fp8 = False
    fp8_calibration = False

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.fp8_meta = {"fp8_checkpoint": False}

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


def _split(in_features, out_features, parallel_mode, tp_size):
    if parallel_mode == "column":
        return in_features, out_features // tp_size, out_features // tp_size
    if parallel_mode == "row":
        return in_features // tp_size, out_features, out_features
    return in_features, out_features, out_features


class Linear(_TEModule):
    def __init__(self, in_features, out_features, bias=True, parallel_mode=None, tp_size=1, **kwargs):
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        rows_in, rows_out, bias_size = _split(in_features, out_features, parallel_mode, tp_size or 1)
        self.weight = Parameter(torch.zeros(rows_out, rows_in))
        if bias:
            self.bias = Parameter(torch.zeros(bias_size))


class LayerNormLinear(Linear):
    def __init__(self, in_features, out_features, normalization="LayerNorm", **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.layer_norm_weight = Parameter(torch.ones(in_features))
        if normalization != "RMSNorm":
            self.layer_norm_bias = Parameter(torch.zeros(in_features))


class GroupedLinear(_TEModule):
    def __init__(self, num_gemms, in_features, out_features, bias=True, parallel_mode=None, tp_size=1, **kwargs):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features, self.use_bias = num_gemms, in_features, out_features, bias
        rows_in, rows_out, bias_size = _split(in_features, out_features, parallel_mode, tp_size or 1)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", Parameter(torch.zeros(rows_out, rows_in)))
            if bias:
                self.register_parameter(f"bias{i}", Parameter(torch.zeros(bias_size)))


class LayerNorm(_TEModule):
    def __init__(self, normalized_shape, **kwargs):
        super().__init__()
        self.weight = Parameter(torch.ones(normalized_shape))
        self.bias = Parameter(torch.zeros(normalized_shape))


class RMSNorm(_TEModule):
    def __init__(self, normalized_shape, **kwargs):
        super().__init__()
        self.weight = Parameter(torch.ones(normalized_shape))


class DotProductAttention(_TEModule):
    pass


_EXPLICIT = {
    "transformer_engine.pytorch": {
        "Linear": Linear,
        "LayerNormLinear": LayerNormLinear,
        "GroupedLinear": GroupedLinear,
        "LayerNorm": LayerNorm,
        "RMSNorm": RMSNorm,
        "DotProductAttention": DotProductAttention,
    },
}


class _AnyValue:
    """Any other Transformer Engine function or value: callable, a context manager, iterable (Megatron unpacks
    ``(context, sync function)`` from the CPU-offload helper), false, and with any attribute."""

    def __call__(self, *args, **kwargs):
        return _AnyValue()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return False

    def __iter__(self):
        return iter((_AnyValue(), _AnyValue()))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyValue()


class _AnyClassMeta(type):
    """Class attributes of any other Transformer Engine class (e.g. ``FP8GlobalStateManager.is_fp8_enabled``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyValue()


_SUBPACKAGES = {"pytorch", "common", "recipe", "ops", "distributed", "fp8", "router", "cpp_extensions", "module"}


class _StandInModule(types.ModuleType):
    """A ``transformer_engine`` (sub)module: the explicit classes above, a subpackage, a new module class for any
    other class name, and an _AnyValue for any other function or value."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        explicit = _EXPLICIT.get(self.__name__, {})
        if name in explicit:
            value = explicit[name]
        elif name in _SUBPACKAGES:
            value = importlib.import_module(f"{self.__name__}.{name}")
        elif name[:1].isupper():
            value = _AnyClassMeta(name, (_TEModule,), {})
        else:
            value = _AnyValue()
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        if spec.name == "transformer_engine":
            module.__version__ = STAND_IN_TE_VERSION
        return module

    def exec_module(self, module):
        pass


# ---- building Megatron's models and describing their keys ---------------------------------------------------------


def _describe(sharded_state_dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories, is_main_replica
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    sharded_state_dict = dict(sharded_state_dict)
    apply_factories(sharded_state_dict)
    pieces = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor):
            kind, local = "tensor", tuple(item.local_shape)
        elif isinstance(item, ShardedObject):
            kind, local = "object", None
        else:
            continue
        pieces.append(
            (
                kind,
                item.key,
                tuple(item.global_shape),
                tuple(item.global_offset),
                local,
                bool(is_main_replica(item.replica_id)),
            )
        )
    return pieces


def _build(rank, name, megatron_path, queue):
    try:
        _build_and_describe(rank, name, megatron_path, queue)
    except BaseException:
        queue.put((rank, None, None))
        raise


def _build_and_describe(rank, name, megatron_path, queue):
    sys.path.insert(0, megatron_path)
    sys.meta_path.insert(0, _StandInFinder())
    import torch.nn.functional as F

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.distributed.init_process_group("gloo", rank=rank, world_size=TP)
    parallel_state.initialize_model_parallel(TP, 1)
    config_fields, model_kwargs, spec_kwargs = MODELS[name]
    fields = {**BASE_CONFIG, **config_fields, "tensor_model_parallel_size": TP}
    if "activation_func" in fields:
        fields["activation_func"] = getattr(F, fields["activation_func"])
    config = TransformerConfig(**fields)
    if spec_kwargs.get("num_experts"):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, **model_kwargs)
    queue.put((rank, _describe(model.sharded_state_dict()), sorted(model.state_dict())))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _listing(pieces_by_rank):
    """``<key> <tensor|object> [global shape] split=<axis>|replicated`` per key, sorted."""
    by_key = {}
    for pieces in pieces_by_rank:
        for kind, key, global_shape, offset, local, main in pieces:
            by_key.setdefault(key, []).append((kind, global_shape, offset, local, main))
    lines = []
    for key, items in sorted(by_key.items()):
        kind, global_shape = items[0][:2]
        offsets = sorted({item[2] for item in items})
        differing = sorted({axis for a in offsets for b in offsets for axis, (x, y) in enumerate(zip(a, b)) if x != y})
        layer_axes = len(global_shape) - (len(items[0][3]) if items[0][3] is not None else 0)
        tp_axes = [axis - layer_axes for axis in differing if axis >= layer_axes] if kind == "tensor" else []
        sharding = f"split={tp_axes[0]}" if tp_axes else "replicated"
        lines.append(f"{key} {kind} {list(global_shape)} {sharding}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron", default="/tmp/mlm", help="Megatron-LM checkout (the folder holding megatron/)")
    parser.add_argument("--output", required=True, help="the golden key file to write")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    context = mp.get_context("spawn")
    sections = []
    for index, name in enumerate(MODELS):
        os.environ["MASTER_PORT"] = str(29600 + index)
        queue = context.Queue()
        processes = [context.Process(target=_build, args=(rank, name, args.megatron, queue)) for rank in range(TP)]
        for process in processes:
            process.start()
        results = sorted((queue.get(timeout=300) for _ in processes), key=lambda result: result[0])
        for process in processes:
            process.join()
        if any(result[1] is None for result in results):
            raise SystemExit(f"building {name!r} failed (see the traceback above)")
        fields, model_kwargs, spec_kwargs = MODELS[name]
        spec_line = json.dumps({"config": fields, "model": model_kwargs, "spec": spec_kwargs}, sort_keys=True)
        state_dict_line = "# state_dict(): " + " ".join(results[0][2])
        sections.append(f"[{name}]\n{spec_line}\n{state_dict_line}\n" + "\n".join(_listing([r[1] for r in results])))
    header = (
        "# Checkpoint keys written by Megatron-Core 0.19's own get_gpt_layer_with_transformer_engine_spec models\n"
        "# (MoE: get_gpt_decoder_block_spec(use_transformer_engine=True)), generated by\n"
        "# tools/checkpoint/megatron_te_spec_keys.py with a stand-in for Transformer Engine's modules (see there).\n"
        f"# Base config {json.dumps(BASE_CONFIG, sort_keys=True)}, vocabulary {VOCAB}, sequence {SEQ}, TP={TP}.\n"
        "# Per section: the model's settings (JSON), its non-distributed state_dict() keys (rank 0), then\n"
        "# <checkpoint key> <tensor|object> <global shape> <split=<TP axis>|replicated>.\n"
    )
    with open(args.output, "w") as out:
        out.write(header + "\n" + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
