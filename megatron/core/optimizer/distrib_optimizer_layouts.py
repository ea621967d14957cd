"""The checkpoint layouts of the distributed optimizer's parameter state (Megatron-Core's ``sharding_type`` values).

Each data-parallel rank holds, for every bucket of every DDP buffer, a contiguous shard: pieces of parameters (its
fp32 main parameter and optimizer state, e.g. Adam's ``exp_avg`` / ``exp_avg_sq``) with alignment padding between
them. Megatron-Core 0.19 stores that state in one of these layouts, and so do we, with the same keys, shapes and
offsets, so a checkpoint moves between the two projects in both directions:

- ``dp_reshardable`` (what ``megatron.training`` writes by default): *bucket space*. Each bucket is one flat tensor
  per state name, ``optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_<(param, grad) dtypes>.bucket_idx_<b>.
  <name>``, of the bucket's unpadded size; every rank writes its shard in place, padding included. No communication;
  it reloads at any data-parallel size whose buckets hold the same parameters (same model, tensor/pipeline layout and
  bucket size), since only the trailing padding depends on the DP size.
- ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): *model space*. The shards are gathered over the
  data-parallel group and stored as whole tensors shaped and sharded like their parameters,
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>``; it reloads at any TP/PP/DP layout.
- ``dp_zero_gather_scatter`` (what Megatron assumes for checkpoints from before Megatron-Core 0.13): every buffer
  gathered on data-parallel rank 0 into padding-free "world" tensors and saved there as one object, scattered back
  on load. It reloads at any data-parallel size with the same buckets.
- ``fully_sharded_model_space`` (deprecated in Megatron): each rank's pieces as flat slices of the model-space
  tensors (``flattened_range``), which Megatron-Core 0.19's own saver no longer accepts; read and written here.

The common part (param groups with the step, and the grad scaler) is, as in Megatron, stored per model-parallel
group as objects (``optimizer.distributed.dp_group_idx_<m>.optimizer``) for the bucket-space layouts and as common
state for the model-space ones.
"""

from typing import Any, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.exchange import gather_and_raise_errors
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.checksums import safe_torch_load_verified, torch_save
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.distributed.param_and_grad_buffer import _all_gather_single

# Layouts that describe the state by model parameter, so they reload at another tensor/pipeline layout too.
MODEL_SPACE_LAYOUTS = ("fully_reshardable", "fully_sharded_model_space")
BUCKET_SPACE_LAYOUTS = ("dp_reshardable", "dp_zero_gather_scatter")
SHARDING_TYPES = BUCKET_SPACE_LAYOUTS + MODEL_SPACE_LAYOUTS
_LOADING = "loading the distributed optimizer's parameter state"


class Piece(NamedTuple):
    """A span ``[start, end)`` of this rank's shard of a bucket: a parameter piece (``entry``) or padding (None)."""

    start: int
    end: int
    entry: Optional[object]


# The methods DistributedOptimizer takes from this module (see its class body). They need from the optimizer:
# ``buffers``, ``data_parallel_group``, ``data_parallel_group_idx``, ``distributed_optimizer_instance_id``,
# ``optimizer`` (the torch optimizer), ``optimizer_state_keys``, ``_entry_of`` (model parameter -> shard entry) and
# ``bucket_pieces`` (per buffer and bucket, this rank's pieces in buffer order, padding included).

# ---- the tensors of one parameter piece ------------------------------------------------------------------------


def _get_main_param_and_optimizer_states(self, model_param) -> Dict[str, torch.Tensor]:
    """``{"param": fp32 main shard, <state name>: tensor}`` of ``model_param``'s piece on this rank."""
    entry = self._entry_of[model_param]
    state = self.optimizer.state[entry.main_param]
    return {"param": entry.main_param, **{name: state[name] for name in self.optimizer_state_keys}}


@torch.no_grad()
def _set_main_param_and_optimizer_states(self, model_param, tensors: Dict[str, torch.Tensor]) -> None:
    for name, value in self._get_main_param_and_optimizer_states(model_param).items():
        if name not in tensors:
            raise KeyError(
                f"DistributedOptimizer: the checkpoint has no {name!r} for a parameter of shape "
                f"{tuple(model_param.shape)}; it was written for another optimizer (states {sorted(tensors)})"
            )
        value.copy_(tensors[name])


def _state_names(self):
    return ("param",) + tuple(self.optimizer_state_keys)


def _dp_rank_and_size(self):
    return dist.get_rank(self.data_parallel_group), dist.get_world_size(self.data_parallel_group)


def _object_key(self, name: str) -> str:
    return f"optimizer.distributed.dp_group_idx_{self.data_parallel_group_idx}.{name}"


# ---- dp_reshardable -------------------------------------------------------------------------------------------


def get_parameter_state_dp_reshardable(self):
    """This rank's state in bucket space, without copies: per buffer, ``{(param dtype, grad dtype): [per
    bucket: [per parameter piece: {"param", <state names>, "gbuf_local_start", "gbuf_local_end"}]]}``, with the
    bucket sizes under ``per_bucket_numel`` / ``per_bucket_numel_unpadded``."""
    state = {"per_bucket_numel": self.per_bucket_numel, "per_bucket_numel_unpadded": self.per_bucket_numel_unpadded}
    for index, buffer in enumerate(self.buffers):
        buckets = [
            [
                {
                    **self._get_main_param_and_optimizer_states(piece.entry.model_param),
                    "gbuf_local_start": piece.start,
                    "gbuf_local_end": piece.end,
                }
                for piece in pieces
                if piece.entry is not None
            ]
            for pieces in self.bucket_pieces[index]
        ]
        state[index] = {_dtype_key(buffer): buckets}
    return state


def sharded_param_state_dp_reshardable(
    self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
):
    """Bucket-space layout: every piece of this rank's shard, padding included, is a slice of its bucket's flat
    tensor (one per state name), so each rank writes and reads only its own shard."""
    dp_rank, dp_size = self._dp_rank_and_size()
    instance = self.distributed_optimizer_instance_id
    state = {
        name: ShardedObject(self._object_key(name), getattr(self, name), (1,), (0,), replica_id=(instance, 0, dp_rank))
        for name in ("per_bucket_numel", "per_bucket_numel_unpadded")
    }
    for index, buffer in enumerate(self.buffers):
        buckets = []
        for bucket_index, (bucket, pieces) in enumerate(zip(buffer.buckets, self.bucket_pieces[index])):
            bucket_key = self._object_key(f"gbuf_idx_{index}.dtype_{_dtype_key(buffer)}.bucket_idx_{bucket_index}")
            shard_start = dp_rank * (bucket.grad_data.numel() // dp_size)
            bucket_state = []
            for piece in pieces:
                if piece.entry is None:
                    tensors = {
                        name: torch.empty(piece.end - piece.start, dtype=self.state_dtype(name, buffer))
                        for name in self._state_names()
                    }
                else:
                    tensors = self._get_main_param_and_optimizer_states(piece.entry.model_param)
                sharded = {
                    name: ShardedTensor(
                        f"{bucket_key}.{name}",
                        tensor,
                        tensor.dtype,
                        tuple(tensor.shape),
                        (bucket.numel_unpadded,),
                        (shard_start + piece.start,),
                        axis_fragmentations=None,
                        # Each rank's slice is its own: every piece is the main replica.
                        replica_id=(instance, 0, 0),
                    )
                    for name, tensor in tensors.items()
                }
                sharded["padding"] = LocalNonpersistentObject(piece.entry is None)
                bucket_state.append(sharded)
            buckets.append(bucket_state)
        state[index] = {_dtype_key(buffer): buckets}
    return state


def load_parameter_state_from_dp_reshardable(self, state_dict) -> None:
    """Inverse of :meth:`sharded_param_state_dp_reshardable` (given its loaded result)."""
    saved = state_dict.get("per_bucket_numel_unpadded")
    if saved is not None and _plain(saved) != _plain(self.per_bucket_numel_unpadded):
        raise ValueError(
            "DistributedOptimizer: this dp_reshardable optimizer checkpoint was written for other buckets "
            f"(unpadded bucket sizes {_plain(saved)}, this run has {_plain(self.per_bucket_numel_unpadded)}). "
            "The dp_reshardable layout reloads only with the same model, tensor/pipeline layout and "
            "--ddp-bucket-size (any data-parallel size); save with --dist-ckpt-optim-fully-reshardable "
            "(fully_reshardable) to change them, or pass --no-load-optim"
        )
    for index, buffer in enumerate(self.buffers):
        if index not in state_dict and not any(self.bucket_pieces[index]):
            continue  # this rank's shard of the buffer is all padding (small FSDP buffers): nothing was saved
        for bucket_state, pieces in zip(state_dict[index][_dtype_key(buffer)], self.bucket_pieces[index]):
            for loaded, piece in zip(bucket_state, pieces):
                if piece.entry is not None:
                    self._set_main_param_and_optimizer_states(piece.entry.model_param, loaded)


# ---- fully_reshardable ------------------------------------------------------------------------------------------


def sharded_param_state_fully_reshardable(
    self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
):
    """Model-space layout: whole state tensors shaped and sharded like their parameters. Saving gathers the
    shards over the data-parallel group; loading reads each parameter's whole tensors and keeps this rank's
    piece (see :meth:`load_parameter_state_from_fully_reshardable`)."""
    sharded_of = _sharded_param_of(model_sharded_state_dict)
    state, index = {}, 0
    for buffer_index, buffer in enumerate(self.buffers):
        whole = None if is_loading else self._gather_buffer(buffer_index)
        for param, (start, end, _) in buffer.param_index_map.items():
            if param not in sharded_of:
                raise ValueError(
                    f"DistributedOptimizer: a parameter of shape {tuple(param.shape)} is not in the model's "
                    "sharded state dict; build the optimizer's sharded state from the same model chunks it steps"
                )
            state[index] = {
                name: make_sharded_optimizer_tensor(
                    sharded_of[param],
                    torch.empty(param.shape, dtype=self.state_dtype(name, buffer))
                    if is_loading
                    else whole[name][start:end].view(param.shape),
                    f"optimizer.state.{name}",
                )
                for name in self._state_names()
            }
            index += 1
    return state


def load_parameter_state_from_fully_reshardable(self, state_dict: dict) -> None:
    """Inverse of :meth:`sharded_param_state_fully_reshardable`: this rank's piece of every loaded tensor."""
    index = 0
    for buffer in self.buffers:
        for param in buffer.param_index_map:
            entry = self._entry_of.get(param)
            if entry is not None:
                piece = slice(entry.shard.param_start, entry.shard.param_end)
                loaded = {name: tensor.reshape(-1)[piece] for name, tensor in state_dict[index].items()}
                self._set_main_param_and_optimizer_states(param, loaded)
            index += 1


def _gather_buffer(self, buffer_index: int) -> Dict[str, torch.Tensor]:
    """``{state name: the whole buffer's state, in its storage dtype}`` on every data-parallel rank (padding zero)."""
    buffer, pieces_by_bucket = self.buffers[buffer_index], self.bucket_pieces[buffer_index]
    dp_rank, dp_size = self._dp_rank_and_size()
    device = buffer.grad_data.device
    whole = {
        name: torch.zeros(buffer.grad_data.numel(), dtype=self.state_dtype(name, buffer), device=device)
        for name in self._state_names()
    }
    for bucket, pieces in zip(buffer.buckets, pieces_by_bucket):
        shard_numel = bucket.grad_data.numel() // dp_size
        for name, tensor in whole.items():
            shard = torch.zeros(shard_numel, dtype=tensor.dtype, device=device)
            for piece in pieces:
                if piece.entry is not None:
                    shard[piece.start : piece.end] = self._get_main_param_and_optimizer_states(piece.entry.model_param)[
                        name
                    ]
            bucket_view = tensor[bucket.offset : bucket.offset + bucket.grad_data.numel()]
            _all_gather_single(bucket_view, shard, group=self.data_parallel_group)
    return {name: tensor.cpu() for name, tensor in whole.items()}


# ---- dp_zero_gather_scatter and the legacy per-file parameter state --------------------------------------------


def get_parameter_state_dp_zero(
    self, use_gloo_comm: bool = True, empty_data: bool = False, return_on_all_ranks: bool = False
):
    """Every buffer's state gathered into padding-free "world" tensors (each bucket's unpadded part, buckets
    concatenated), on data-parallel rank 0 (None elsewhere) or on every rank: ``{"buckets_coalesced": True,
    <buffer index>: {(param dtype, grad dtype): {"param": ..., <state names>: ..., "numel_unpadded": n}}}``.
    ``use_gloo_comm`` is accepted for Megatron's signature: the gather runs on the data-parallel group."""
    dp_rank, _ = self._dp_rank_and_size()
    if not (dp_rank == 0 or return_on_all_ranks):
        if not empty_data:
            for index in range(len(self.buffers)):
                self._gather_buffer(index)  # a collective: the other ranks take part
        return None
    state = {"buckets_coalesced": True}
    for index, buffer in enumerate(self.buffers):
        numel_unpadded = sum(bucket.numel_unpadded for bucket in buffer.buckets)
        if empty_data:
            world = {
                name: torch.zeros(numel_unpadded, dtype=self.state_dtype(name, buffer)) for name in self._state_names()
            }
        else:
            whole = self._gather_buffer(index)
            world = {name: _drop_bucket_padding(tensor, buffer) for name, tensor in whole.items()}
        state[index] = {_dtype_key(buffer): {**world, "numel_unpadded": numel_unpadded}}
    return state


def sharded_param_state_dp_zero(
    self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
):
    """The world tensors of :meth:`get_parameter_state_dp_zero` as one object saved by data-parallel rank 0."""
    data = None if is_loading else self.get_parameter_state_dp_zero()
    if self._dp_rank_and_size()[0] != 0:
        return LocalNonpersistentObject(None)
    return ShardedObject(self._object_key("param_state"), data, (1,), (0,))


@torch.no_grad()
def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format=False) -> None:
    """Inverse of :meth:`get_parameter_state_dp_zero`: data-parallel rank 0 holds ``state_dict`` (None on the
    others) and sends each rank its shards."""
    if update_legacy_format:
        raise ValueError(
            "DistributedOptimizer: parameter state files from before 'buckets_coalesced' "
            "(update_legacy_format=True) are not supported; convert the checkpoint with Megatron-LM first"
        )
    dp_rank, dp_size = self._dp_rank_and_size()
    source = dist.get_global_rank(self.data_parallel_group, 0)
    error = _world_state_error(state_dict, self.buffers) if dp_rank == 0 else None
    # Only rank 0 sees the state: the others must stop with it rather than wait for its broadcasts.
    gather_and_raise_errors(error, _LOADING, self.data_parallel_group)
    for index, buffer in enumerate(self.buffers):
        device = buffer.grad_data.device
        world = state_dict[index][_dtype_key(buffer)] if dp_rank == 0 else None
        for name in self._state_names():
            offset = 0
            for bucket, pieces in zip(buffer.buckets, self.bucket_pieces[index]):
                padded = torch.zeros(bucket.grad_data.numel(), dtype=self.state_dtype(name, buffer), device=device)
                if dp_rank == 0:
                    padded[: bucket.numel_unpadded] = world[name][offset : offset + bucket.numel_unpadded]
                offset += bucket.numel_unpadded
                dist.broadcast(padded, source, group=self.data_parallel_group)
                shard = padded.chunk(dp_size)[dp_rank]
                for piece in pieces:
                    if piece.entry is not None:
                        target = self._get_main_param_and_optimizer_states(piece.entry.model_param)[name]
                        target.copy_(shard[piece.start : piece.end])


def save_parameter_state(self, filename: str) -> None:
    """Write :meth:`get_parameter_state_dp_zero` to ``filename`` on data-parallel rank 0 (the legacy
    ``distrib_optim.pt`` of a ``--ckpt-format torch`` checkpoint)."""
    state = self.get_parameter_state_dp_zero()
    if self._dp_rank_and_size()[0] == 0:
        torch_save(state, filename)


def load_parameter_state(self, filename: str, *, update_legacy_format=False) -> None:
    """Read a file written by :meth:`save_parameter_state` (data-parallel rank 0 reads it, with the safe
    loader) and give every rank its shards."""
    state, error = None, None
    if self._dp_rank_and_size()[0] == 0:
        try:
            state = safe_torch_load_verified(filename, f"the distributed optimizer's parameter state {filename}")
        except CheckpointingException as unreadable:
            error = unreadable
    gather_and_raise_errors(error, _LOADING, self.data_parallel_group)
    self.load_parameter_state_from_dp_zero(state, update_legacy_format=update_legacy_format)


# ---- ChainedOptimizer's legacy parameter-state file --------------------------------------------------------------
# ChainedOptimizer (optimizer.py) takes these two as its save_parameter_state / load_parameter_state.


def save_chained_parameter_state(self, filename: str):
    """One chained optimizer writes its own file (see :meth:`save_parameter_state`). Several (e.g. dense and
    expert) write one list, as Megatron does: per distributed optimizer in chain order, its world tensors, or None
    where this rank is not rank 0 of that optimizer's data-parallel group; a rank that is rank 0 of none writes
    nothing."""
    if len(self.chained_optimizers) == 1:
        self.chained_optimizers[0].save_parameter_state(filename)
        return
    states = [member.get_parameter_state_dp_zero() for member in _distributed_members(self)]
    if any(state is not None for state in states):
        torch_save(states, filename)


def load_chained_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
    """Read a file written by :func:`save_chained_parameter_state`: the ranks that are data-parallel rank 0 of
    any chained distributed optimizer read it and hand each optimizer its entry to scatter. A collective over all
    ranks."""
    if len(self.chained_optimizers) == 1:
        self.chained_optimizers[0].load_parameter_state(filename, update_legacy_format=update_legacy_format)
        return
    members = _distributed_members(self)
    reads = [member._dp_rank_and_size()[0] == 0 for member in members]
    states, error = [None] * len(members), None
    if any(reads):
        try:
            states = safe_torch_load_verified(filename, f"the chained optimizers' parameter state {filename}")
        except CheckpointingException as unreadable:
            error = unreadable
        else:
            if not isinstance(states, list) or len(states) != len(members):
                held = f"a list of {len(states)}" if isinstance(states, list) else f"a {type(states).__name__}"
                error = CheckpointingException(
                    f"{filename} holds {held} parameter states, but this run chains {len(members)} distributed "
                    "optimizers (e.g. dense and expert parameters); it was written for a different model"
                )
    # The reader may be rank 0 of one optimizer's group only: every rank stops with it.
    gather_and_raise_errors(error, _LOADING)
    for member, state, read in zip(members, states, reads):
        member.load_parameter_state_from_dp_zero(state if read else None, update_legacy_format=update_legacy_format)


def _distributed_members(chained) -> list:
    """The chained optimizers whose parameter state is sharded over data-parallel ranks."""
    return [member for member in chained.chained_optimizers if hasattr(member, "get_parameter_state_dp_zero")]


def bucket_pieces(entries, buffer, dp_rank: int) -> List[List[Piece]]:
    """Per bucket of ``buffer``: this rank's pieces of its shard in buffer order, with the padding between them.

    As in Megatron, padding is described only up to the bucket's unpadded end (the trailing bucket padding depends
    on the data-parallel size, so it is never stored).
    """
    dp_size = buffer.data_parallel_world_size
    by_bucket: List[List] = [[] for _ in buffer.buckets]
    for entry in entries:
        if entry.model_param in buffer.param_index_map:
            by_bucket[buffer.param_index_map[entry.model_param][2]].append(entry)
    result = []
    for bucket, bucket_entries in zip(buffer.buckets, by_bucket):
        shard_numel = bucket.grad_data.numel() // dp_size
        shard_start = bucket.offset + dp_rank * shard_numel
        # Parts of the shard past the bucket's unpadded end are never stored.
        data_end = max(0, min(shard_numel, bucket.offset + bucket.numel_unpadded - shard_start))
        pieces, cursor = [], 0
        for entry in sorted(bucket_entries, key=lambda e: e.shard.buffer_start):
            start, end = entry.shard.buffer_start - shard_start, entry.shard.buffer_end - shard_start
            if start > cursor:
                pieces.append(Piece(cursor, start, None))
            pieces.append(Piece(start, end, entry))
            cursor = end
        if cursor < data_end:
            pieces.append(Piece(cursor, data_end, None))
        result.append(pieces)
    return result


def _dtype_key(buffer):
    return (buffer.param_dtype, buffer.grad_dtype)


def _plain(per_bucket):
    """Bucket sizes as a comparable value (the dtype keys stay as they are)."""
    return [dict(sizes) for sizes in per_bucket]


def _sharded_param_of(model_sharded_state_dict) -> Dict[torch.nn.Parameter, object]:
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {sharded.data: sharded for sharded in nested_values(tensors)}


def _drop_bucket_padding(whole: torch.Tensor, buffer) -> torch.Tensor:
    return torch.cat([whole[bucket.offset : bucket.offset + bucket.numel_unpadded] for bucket in buffer.buckets])


def _world_state_error(state_dict, buffers) -> Optional[CheckpointingException]:
    """Why ``state_dict`` (world tensors) cannot be loaded into ``buffers``, or None."""
    if not isinstance(state_dict, dict) or not state_dict.get("buckets_coalesced"):
        return CheckpointingException(
            "DistributedOptimizer: the saved parameter state is not a dp_zero_gather_scatter state "
            "(no 'buckets_coalesced' world tensors); it was written by another optimizer or is corrupt"
        )
    for index, buffer in enumerate(buffers):
        numel_unpadded = sum(bucket.numel_unpadded for bucket in buffer.buckets)
        saved = state_dict.get(index, {}).get(_dtype_key(buffer), {}).get("numel_unpadded")
        if saved != numel_unpadded:
            return CheckpointingException(
                f"DistributedOptimizer: buffer {index} holds {numel_unpadded} unpadded elements in this run but "
                f"{saved} in the checkpoint's parameter state; the dp_zero_gather_scatter layout reloads only with the "
                "same model, tensor/pipeline layout and buckets; pass --no-load-optim to start the optimizer afresh"
            )
    return None
