"""Moving weights between HF checkpoints and Megatron models or checkpoints, driven by the family tables.

- :func:`load_hf_weights` fills a (TP/PP-sharded) GPTModel, or a HybridModel for NemotronH, in memory from an HF
  directory; :func:`build_model_from_hf` builds that model for this rank's stage first.
- :func:`save_megatron_checkpoint_from_hf` writes a Megatron training checkpoint (``torch_dist``), streaming: the
  model is built on the meta device and each tensor is read from the memory-mapped safetensors when the writer
  reaches it.
- :func:`export_megatron_checkpoint_to_hf` writes ``config.json`` + safetensors from a Megatron checkpoint, reading
  one tensor at a time; :func:`hf_state_dict_from_model` does the same from a single-process model in memory.

Every HF tensor is accounted for both ways: a tensor neither side expects, or one that is missing, is refused
before anything is written.
"""

import dataclasses
import os
import re
import shutil
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.core.models.huggingface.config import (
    checkpoint_args_from_settings,
    hf_config_for_export,
    model_class_and_kwargs,
    padded_vocab_size,
    read_hf_config,
    settings_from_checkpoint_args,
    settings_from_hf_config,
    torch_dtype,
    transformer_config_from_settings,
)
from megatron.core.models.huggingface.families import (
    FamilyAdapter,
    ModelSettings,
    UnsupportedHFModelError,
    WeightRule,
    family_for_architecture,
    family_for_settings,
)
from megatron.core.models.huggingface.weights import (
    HFCheckpointReader,
    tensor_parallel_sections_slice,
    tensor_parallel_slice,
    to_hf,
    to_megatron,
    write_safetensors_streamed,
)

# Files of a tokenizer saved by transformers: copied along, never parsed here.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
# Where a converted Megatron checkpoint keeps the source's tokenizer files (beside the tracker).
TOKENIZER_SUBDIR = "hf_tokenizer"
HF_CONFIG_KEY = "hf_config"  # the source config.json, in the checkpoint's common state


# ---- the rules of one model ----------------------------------------------------------------------------------------


def expand_rules(family: FamilyAdapter, settings: ModelSettings) -> Dict[str, WeightRule]:
    """Megatron state-dict name (global layer numbers) -> rule, for every tensor of the model."""
    rules = {rule.megatron: rule for rule in family.global_rules(settings)}
    kinds = (settings.hybrid_layer_pattern or "").replace("|", "")
    for layer in range(settings.num_layers):
        for rule in family.layer_rules(settings):
            if rule.kind is not None and (layer >= len(kinds) or kinds[layer] != rule.kind):
                continue  # a hybrid's rule for another kind of layer
            expanded = dataclasses.replace(
                rule, megatron=rule.megatron.format(layer=layer), hf=tuple(n.format(layer=layer) for n in rule.hf)
            )
            rules[expanded.megatron] = expanded
    return rules


def _hf_names_expected(rules: Dict[str, WeightRule], settings: ModelSettings) -> List[str]:
    names = []
    for rule in rules.values():
        if rule.megatron == "output_layer.weight" and not settings.untie_embeddings_and_output_weights:
            continue  # tied: the output layer is the embedding, stored once
        names.extend(name for name in rule.hf if name not in names)
    return names


def check_hf_tensors(
    reader: HFCheckpointReader, family: FamilyAdapter, settings: ModelSettings, rules: Dict[str, WeightRule]
) -> None:
    """Refuse, naming them, HF tensors the model lacks a place for and model tensors the files lack."""
    present = set(reader.names())
    expected = _hf_names_expected(rules, settings)
    tied = not settings.untie_embeddings_and_output_weights
    if tied and "lm_head.weight" in present:
        raise UnsupportedHFModelError(
            f"{reader.directory}: config.json says tie_word_embeddings=true but the checkpoint holds its own "
            "lm_head.weight; set tie_word_embeddings to false if the output layer is separate"
        )
    if not tied and "lm_head.weight" not in present:
        raise UnsupportedHFModelError(
            f"{reader.directory}: config.json says tie_word_embeddings=false but the checkpoint has no "
            "lm_head.weight; set tie_word_embeddings to true if the output layer is the embedding"
        )
    missing = [name for name in expected if name not in present]
    unexpected = sorted(
        name
        for name in present - set(expected)
        if not any(name.endswith(suffix) for suffix in family.ignorable_hf_suffixes)
    )
    if missing:
        raise UnsupportedHFModelError(
            f"{reader.directory}: tensors missing from the checkpoint: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)"
        )
    if unexpected:
        raise UnsupportedHFModelError(
            f"{reader.directory}: tensors with no place in the {family.name} mapping (nothing is dropped "
            f"silently): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all)"
        )


def open_hf_model(hf_dir: str) -> Tuple[FamilyAdapter, ModelSettings, dict, HFCheckpointReader, Dict[str, WeightRule]]:
    """Read and check an HF directory: (family, settings, config, reader, rules); raises before any write."""
    config = read_hf_config(hf_dir)
    family, settings = settings_from_hf_config(config)
    reader = HFCheckpointReader(hf_dir, family.optional_hf_prefix)
    rules = expand_rules(family, settings)
    check_hf_tensors(reader, family, settings, rules)
    return family, settings, config, reader, rules


def _megatron_tensor(rule: WeightRule, reader: HFCheckpointReader, settings: ModelSettings, vocab: int):
    return to_megatron(rule.transform, [reader.get(name) for name in rule.hf], settings, vocab)


# ---- HF -> a Megatron model in memory -------------------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# Optimizer state keys of a training checkpoint: "optimizer.", or "chained_<i>.optimizer." when an MoE run chains
# the dense and expert optimizers.
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def _global_name(chunk: torch.nn.Module, local_name: str) -> str:
    """``decoder.layers.<local index>.x`` -> ``decoder.layers.<global index>.x`` (a pipeline stage numbers its layers
    from 0; ``layer_number`` is global and 1-based), and an expert's local index -> its global one (an EP rank holds
    experts ``local_expert_offset ...``)."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    layer = chunk.decoder.layers[int(match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}." + local_name[match.end() :]
    expert = _EXPERT.search(name)
    if expert is not None:
        offset = layer.mlp.experts.local_expert_offset
        name = f"{name[: expert.start()]}.experts.local_experts.{offset + int(expert.group(1))}.{name[expert.end() :]}"
    return name


def load_hf_weights(model, hf_dir: str, tp_rank: Optional[int] = None, tp_size: Optional[int] = None) -> None:
    """Fill the GPTModel / HybridModel chunk(s) ``model`` (this rank's stage, any TP/PP) from the HF checkpoint in
    ``hf_dir``.

    Each parameter gets its piece of the full HF-derived tensor; every parameter must have a source and every HF
    tensor a destination (checked before the first copy). The model must have been built from the same config
    (see :func:`build_model_from_hf`)."""
    from megatron.core import parallel_state

    chunks = model if isinstance(model, (list, tuple)) else [model]
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    # Experts are split over the expert tensor-parallel group (by default the same size as TP).
    expert_tp = (
        (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
        if parallel_state.model_parallel_is_initialized()
        else (tp_rank, tp_size)
    )
    family, settings, _, reader, rules = open_hf_model(hf_dir)
    plan = []
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for local_name, param in chunk.named_parameters():
            name = _global_name(chunk, local_name)
            if name not in rules:
                raise UnsupportedHFModelError(
                    f"model parameter {name} has no source in the {family.name} mapping; the model was not "
                    f"built from {hf_dir}'s config"
                )
            plan.append((name, param, chunk.vocab_size))
    for name, param, vocab in plan:
        rule = rules[name]
        full = _megatron_tensor(rule, reader, settings, vocab)
        if rule.tp_sections is not None:
            piece = tensor_parallel_sections_slice(full, rule.tp_sections, tp_rank, tp_size)
        else:
            rank, size = expert_tp if _EXPERT.search(name) else (tp_rank, tp_size)
            piece = tensor_parallel_slice(full, param, rank, size)
        if piece.shape != param.shape:
            raise UnsupportedHFModelError(
                f"{name}: the HF tensors give {tuple(piece.shape)} on this rank, the model has "
                f"{tuple(param.shape)}; build the model from {hf_dir}'s config"
            )
        with torch.no_grad():
            param.copy_(piece)


def build_model_from_hf(
    hf_dir: str,
    pre_process: bool = True,
    post_process: bool = True,
    make_vocab_size_divisible_by: int = 128,
    load_weights: bool = True,
    **config_overrides,
):
    """A GPTModel (a HybridModel for NemotronH) for this rank's TP/PP stage with the HF model's architecture and
    (unless ``load_weights=False``) its weights. ``config_overrides`` go to the TransformerConfig (the parallel
    layout: defaults are parallel_state's TP and PP sizes; an MoE model under TP defaults to sequence parallelism,
    which its training needs: pass ``sequence_parallel=False`` to evaluate or generate without it)."""
    from megatron.core import parallel_state

    _, settings = settings_from_hf_config(read_hf_config(hf_dir))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config_overrides.setdefault("tensor_model_parallel_size", tp)
    config_overrides.setdefault("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())
    config_overrides.setdefault("perform_initialization", not load_weights)  # every weight is overwritten
    if settings.num_moe_experts and config_overrides["tensor_model_parallel_size"] > 1:
        config_overrides.setdefault("sequence_parallel", True)  # MoELayer trains under TP only with SP
    if config_overrides["pipeline_model_parallel_size"] > 1:
        config_overrides.setdefault("pipeline_dtype", torch_dtype(settings))
    config = transformer_config_from_settings(settings, **config_overrides)
    model_class, kwargs = model_class_and_kwargs(settings, tp, make_vocab_size_divisible_by)
    model = model_class(config, pre_process=pre_process, post_process=post_process, **kwargs)
    if load_weights:
        load_hf_weights(model, hf_dir)
    return model


build_gpt_model_from_hf = build_model_from_hf  # the name from before hybrids; builds either model


# ---- a structure-only model (the meta device) ------------------------------------------------------------------------


def _meta_model(settings: ModelSettings, vocab_size: int):
    """The single-process GPTModel / HybridModel of ``settings`` with no storage: its sharded state dict names every
    tensor of the checkpoint (keys, global shapes, layer offsets) exactly as training writes and reads them."""
    # CPU initialisation for a hybrid: the Mamba mixer draws its conv, dt and A values even without
    # initialisation; so they are drawn on the meta device too, not from an RNG stream a converter has not set up.
    hybrid = settings.hybrid_layer_pattern is not None
    config = transformer_config_from_settings(settings, use_cpu_initialization=hybrid, perform_initialization=False)
    model_class, kwargs = model_class_and_kwargs(settings)
    kwargs["vocab_size"] = vocab_size
    with torch.device("meta"):
        return model_class(config, **kwargs)


@dataclasses.dataclass(frozen=True)
class _StoredTensor:
    """Where a model tensor lives in a torch_dist checkpoint: its key, its (index, count) on each stacked leading
    axis (``((layer, layers),)``, plus ``(expert, experts)`` for an expert's; ``()`` outside the layers and for
    tensors stored one key per layer, as a hybrid's), and its full (TP = 1) shape. ``segments``: (key, rows) of each
    piece when the tensor is stored as one key per row segment (the Mamba in_proj's ``.z .x .B .C .dt``, the conv's
    ``.x .B .C``)."""

    key: str
    axes: Tuple[int, ...]
    shape: Tuple[int, ...]
    segments: Tuple[Tuple[str, int], ...] = ()

    def keys(self) -> List[str]:
        return [key for key, _ in self.segments] or [self.key]


def _stored_tensors(settings: ModelSettings, vocab_size: int) -> Dict[str, "_StoredTensor"]:
    """State-dict name -> :class:`_StoredTensor` for every model tensor, read off the structure-only model's
    sharded state dict (so the names are exactly training's; a factory, such as the gated fc1's [gate; up], stores
    the same full tensor in pieces)."""
    model = _meta_model(settings, vocab_size)
    shapes = {
        name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)
    }
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    stored = {}
    for name, entry in model.sharded_state_dict().items():
        if name not in shapes:
            continue  # extra states (ShardedObjects)
        pieces = list(entry.build().values()) if isinstance(entry, ShardedTensorFactory) else [entry]
        first = pieces[0]
        axes = tuple(zip(first.global_offset[: first.prepend_axis_num], first.global_shape[: first.prepend_axis_num]))
        segments = tuple(
            (piece.key, piece.global_shape[first.prepend_axis_num]) for piece in pieces if piece.key != entry.key
        )
        stored[name] = _StoredTensor(entry.key, axes, shapes[name], segments)
    return stored


def _single_process_group() -> Callable[[], None]:
    """A one-rank gloo group and TP = PP = 1, as the writers need; returns the cleanup (nothing to undo when the
    caller already set them up)."""
    import torch.distributed as dist

    from megatron.core import parallel_state

    created = False
    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:  # a free local port for the one-rank rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        created = True
    if dist.get_world_size() != 1:
        raise RuntimeError(
            "checkpoint conversion runs in a single process (the checkpoint is written at TP=PP=1 and reshards on load)"
        )
    initialized = parallel_state.model_parallel_is_initialized()
    if not initialized:
        parallel_state.initialize_model_parallel()

    def cleanup():
        if not initialized:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()

    return cleanup


def check_model_type(model_type: Optional[str], family: FamilyAdapter, where: str) -> None:
    """Refuse a ``--model-type`` that is not the family's (a hybrid is trained by pretrain_hybrid.py, a GPT by
    pretrain_gpt.py: the wrong one would not build the model)."""
    if model_type is not None and model_type != family.model_type:
        raise UnsupportedHFModelError(
            f"--model-type {model_type}, but {where} holds a {family.name} model ({family.architectures[0]}), which "
            f"converts as --model-type {family.model_type}"
        )


# ---- HF -> a Megatron checkpoint, streamed --------------------------------------------------------------------------


def save_megatron_checkpoint_from_hf(
    hf_dir: str,
    save_dir: str,
    target_tensor_parallel_size: int = 1,
    target_pipeline_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    model_type: Optional[str] = None,
) -> str:
    """Write the HF model of ``hf_dir`` as a Megatron training checkpoint under ``save_dir`` (``release/`` +
    ``latest_checkpointed_iteration.txt``, torch_dist) whose ``args`` say the target TP/PP; the tensors are stored
    whole and reshard on load. ``model_type`` (convert.py's ``--model-type``), when given, must be the family's
    ('GPT', or 'hybrid' for NemotronH). Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.dist_checkpointing.checkpoint_dir import (
        CHECKPOINT_VERSION,
        RELEASE_DIRNAME,
        get_checkpoint_name,
        write_tracker_atomically,
    )

    family, settings, hf_config, reader, rules = open_hf_model(hf_dir)
    check_model_type(model_type, family, hf_dir)
    for name, size in (
        ("--target-tensor-parallel-size", target_tensor_parallel_size),
        ("--target-pipeline-parallel-size", target_pipeline_parallel_size),
    ):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    if settings.num_layers % target_pipeline_parallel_size:
        raise ValueError(
            f"--target-pipeline-parallel-size {target_pipeline_parallel_size} does not divide the "
            f"{settings.num_layers} layers"
        )
    sizes = [(settings.num_query_groups, "key/value heads"), (settings.ffn_hidden_size, "MLP channels")]
    if settings.hybrid_layer_pattern is not None:
        sizes += [(settings.mamba_num_heads, "Mamba heads"), (settings.mamba_num_groups, "Mamba groups")]
    for count, what in sizes:
        if count % target_tensor_parallel_size:
            raise ValueError(
                f"--target-tensor-parallel-size {target_tensor_parallel_size} does not divide the {count} {what}"
            )
    vocab = padded_vocab_size(settings.vocab_size, make_vocab_size_divisible_by, target_tensor_parallel_size)
    tokenizer_files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    tokenizer_dir = os.path.abspath(os.path.join(save_dir, TOKENIZER_SUBDIR))
    args = checkpoint_args_from_settings(
        settings,
        target_tensor_parallel_size,
        target_pipeline_parallel_size,
        make_vocab_size_divisible_by,
        tokenizer_model=tokenizer_dir if "tokenizer.json" in tokenizer_files else None,
    )
    cleanup = _single_process_group()
    try:
        sharded = _meta_model(settings, vocab).sharded_state_dict()
        # (key, stacked-axis indices) -> model tensor name; segment key -> its first row in the tensor
        name_of, row_of = {}, {}
        for name, t in _stored_tensors(settings, vocab).items():
            name_of[(t.key, tuple(index for index, _ in t.axes))] = name
            start = 0
            for key, rows in t.segments:
                name_of[(key, tuple(index for index, _ in t.axes))], row_of[key] = name, start
                start += rows
        last: Dict[str, torch.Tensor] = {}  # the factory pieces of one tensor (fc1's gate, up) arrive in a row

        class StreamFromHF(TorchDistSaveShardedStrategy):
            """Each stored piece is cut from its full tensor, built from the HF files when the writer reaches it."""

            def materialize(self, shard):
                name = name_of[(shard.key, tuple(shard.global_offset[: shard.prepend_axis_num]))]
                if name not in last:
                    last.clear()
                    last[name] = _megatron_tensor(rules[name], reader, settings, vocab).to(shard.dtype)
                offsets = list(shard.global_offset[shard.prepend_axis_num :])
                if shard.key in row_of:  # a segment of the tensor's rows, stored under its own key
                    offsets[0] += row_of[shard.key]
                box = tuple(slice(offset, offset + size) for offset, size in zip(offsets, shard.local_shape))
                return last[name][box]

        checkpoint_dir = get_checkpoint_name(save_dir, 0, release=True, return_base_dir=True)
        os.makedirs(checkpoint_dir, exist_ok=True)
        state = {
            "model": sharded,
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0,
            HF_CONFIG_KEY: hf_config,
        }
        # The layout flags a run records (content_metadata): a model without a distributed optimizer.
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": False}
        dist_checkpointing.save(state, checkpoint_dir, StreamFromHF(), content_metadata=metadata)
        if tokenizer_files:
            os.makedirs(tokenizer_dir, exist_ok=True)
            for file_name in tokenizer_files:
                shutil.copy2(os.path.join(hf_dir, file_name), tokenizer_dir)
        write_tracker_atomically(save_dir, RELEASE_DIRNAME)
        return checkpoint_dir
    finally:
        cleanup()


# ---- Megatron -> HF --------------------------------------------------------------------------------------------------


def iter_hf_tensors(
    family: FamilyAdapter,
    settings: ModelSettings,
    rules: Dict[str, WeightRule],
    get_tensor: Callable[[str], torch.Tensor],
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) for the whole model, from ``get_tensor(megatron name)`` (full tensors), one rule at a time."""
    for rule in _export_rules(rules, settings):
        for name, tensor in zip(rule.hf, to_hf(rule.transform, get_tensor(rule.megatron), settings)):
            yield name, tensor


def _export_rules(rules: Dict[str, WeightRule], settings: ModelSettings) -> List[WeightRule]:
    tied = not settings.untie_embeddings_and_output_weights
    return [rule for name, rule in rules.items() if not (tied and name == "output_layer.weight")]


def hf_state_dict_from_model(
    model,
    family: Optional[FamilyAdapter] = None,
    settings: Optional[ModelSettings] = None,
    hf_dir: Optional[str] = None,
) -> dict:
    """The HF state dict of a single-process (TP = PP = 1) GPTModel / HybridModel; the family and settings come from
    ``hf_dir``'s config.json, or are given."""
    if hf_dir is not None:
        family, settings = settings_from_hf_config(read_hf_config(hf_dir))
    rules = expand_rules(family, settings)
    state = {name: tensor for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)}
    _check_megatron_names(set(state), rules, settings, "the model")
    return dict(iter_hf_tensors(family, settings, rules, lambda name: state[name].detach()))


def _check_megatron_names(present: set, rules: Dict[str, WeightRule], settings: ModelSettings, what: str) -> None:
    wanted = {rule.megatron for rule in _export_rules(rules, settings)}
    missing, unexpected = sorted(wanted - present), sorted(present - wanted)
    if missing:
        raise UnsupportedHFModelError(f"{what} lacks tensors the HF model needs: {missing[:8]}")
    if unexpected:
        raise UnsupportedHFModelError(
            f"{what} holds tensors with no place in the HF model (nothing is dropped silently): {unexpected[:8]}"
        )


def export_megatron_checkpoint_to_hf(
    load_dir: str,
    save_dir: str,
    max_shard_bytes: int = 5 * 10**9,
    hf_architecture: Optional[str] = None,
    true_vocab_size: Optional[int] = None,
    model_type: Optional[str] = None,
) -> List[str]:
    """Write the Megatron checkpoint of ``load_dir`` (its latest, or ``release``) as an HF model in ``save_dir``:
    ``config.json``, safetensors (sharded with an index above ``max_shard_bytes``) and the tokenizer files when the
    checkpoint came with them. ``true_vocab_size`` strips the vocabulary padding (default: the size the checkpoint
    or its tokenizer says). Returns the files written."""
    import json

    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, read_dcp_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from megatron.core.dist_checkpointing.checkpoint_dir import find_checkpoint_to_load

    found = find_checkpoint_to_load(load_dir)
    if found is None:
        raise UnsupportedHFModelError(f"{load_dir}: no Megatron checkpoint (latest_checkpointed_iteration.txt missing)")
    checkpoint_dir = found[0]
    common = load_common_state_dict(checkpoint_dir)
    if common.get("args") is None:
        raise UnsupportedHFModelError(f"{checkpoint_dir}: the checkpoint holds no args; it cannot be exported")
    args, source_config = common["args"], common.get(HF_CONFIG_KEY)
    settings = settings_from_checkpoint_args(args, true_vocab_size)
    if hf_architecture is None and source_config:
        hf_architecture = (source_config.get("architectures") or [None])[0]
    family = family_for_architecture(hf_architecture) if hf_architecture else family_for_settings(settings)
    check_model_type(model_type, family, checkpoint_dir)
    if (family.model_type == "hybrid") != (settings.hybrid_layer_pattern is not None):
        raise UnsupportedHFModelError(
            f"{checkpoint_dir}: --hf-architecture {family.architectures[0]} is a {family.model_type} family, but the "
            f"checkpoint's model is {'a hybrid' if settings.hybrid_layer_pattern else 'a GPT'}"
        )
    rules = expand_rules(family, settings)
    config = hf_config_for_export(family, settings, source_config)  # refuses what the family cannot express
    vocab = getattr(args, "padded_vocab_size", None) or padded_vocab_size(
        settings.vocab_size,
        getattr(args, "make_vocab_size_divisible_by", 128),
        getattr(args, "tensor_model_parallel_size", 1),
    )
    cleanup = _single_process_group()
    try:
        tensors = _stored_tensors(settings, vocab)
        _check_megatron_names(set(tensors), rules, settings, f"the model of {checkpoint_dir}")
        stored = {
            key: entry
            for key, entry in read_dcp_metadata(checkpoint_dir).state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata) and not _OPTIMIZER_KEY.match(key)
        }
        model_keys = {key for t in tensors.values() for key in t.keys()}
        if stored.keys() - model_keys or model_keys - stored.keys():
            raise UnsupportedHFModelError(
                f"{checkpoint_dir}: its tensors do not match the model of its args: unexpected "
                f"{sorted(stored.keys() - model_keys)[:8]}, missing {sorted(model_keys - stored.keys())[:8]}"
            )
        strategy = TorchDistLoadShardedStrategy(cache_metadata=True)
        dtype = {name: stored[t.keys()[0]].properties.dtype for name, t in tensors.items()}

        def read(name: str) -> torch.Tensor:
            """One full model tensor (one layer's, or one layer's expert's, slice of a stacked key; its segments'
            keys, concatenated), read alone."""
            t = tensors[name]
            axes = [(axis, index, count) for axis, (index, count) in enumerate(t.axes)]
            pieces = t.segments or ((t.key, t.shape[0]),)
            targets = {
                key: ShardedTensor.from_rank_offsets(
                    key, torch.empty((rows, *t.shape[1:]), dtype=dtype[name]), *axes, prepend_axis_num=len(axes)
                )
                for key, rows in pieces
            }
            loaded = strategy.load_local(targets, checkpoint_dir)
            return loaded[t.key] if not t.segments else torch.cat([loaded[key] for key, _ in pieces])

        entries = [
            (name, x.shape, x.dtype)
            for name, x in iter_hf_tensors(
                family, settings, rules, lambda name: torch.empty(tensors[name].shape, dtype=dtype[name], device="meta")
            )
        ]
        os.makedirs(save_dir, exist_ok=True)
        written = write_safetensors_streamed(
            save_dir, entries, iter_hf_tensors(family, settings, rules, read), max_shard_bytes
        )
    finally:
        cleanup()
    with open(os.path.join(save_dir, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    written.append("config.json")
    written.extend(_copy_tokenizer(load_dir, args, save_dir))
    return written


def _copy_tokenizer(load_dir: str, args, save_dir: str) -> List[str]:
    """The tokenizer files that came with the checkpoint (converted from HF, or trained with a local HF
    tokenizer directory), copied next to the exported weights."""
    candidates = [os.path.join(load_dir, TOKENIZER_SUBDIR)]
    if getattr(args, "tokenizer_type", None) == "HuggingFaceTokenizer" and getattr(args, "tokenizer_model", None):
        candidates.append(str(args.tokenizer_model))
    for directory in candidates:
        if os.path.isdir(directory):
            files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, f))]
            for file_name in files:
                shutil.copy2(os.path.join(directory, file_name), save_dir)
            return files
    return []
