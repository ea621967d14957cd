"""Megatron-LM's training application: ``from megatron.training import get_args, pretrain, print_rank_0, ...``
works as it does in Megatron-LM. Submodules: arguments (flags), initialize (start-up), training (the loop),
model_setup (model, optimizer, data), checkpointing, global_vars, utils."""

from megatron.training.global_vars import (
    get_adlr_autoresume,
    get_args,
    get_one_logger,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    get_wandb_writer,
)
from megatron.training.initialize import initialize_megatron
from megatron.training.model_setup import get_model, get_train_valid_test_num_samples
from megatron.training.progress_log import set_startup_timestamps
from megatron.training.training import pretrain
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last
