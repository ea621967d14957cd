"""What Megatron-LM's flags accept: the choice lists, the value types of the pattern and tuple flags, and the tables
of the flags this project does not implement. Both the parser (``arguments``) and ``validate_args``
(``argument_validation``) read them, so they live below both.
"""

import argparse
import ast

from megatron.core.public_api import public_api
from megatron.training.arguments_model_flags import TABLES as MODEL_FLAG_TABLES
from megatron.training.arguments_run_flags import TABLES as RUN_FLAG_TABLES
from megatron.training.arguments_service_flags import TABLES as SERVICE_FLAG_TABLES

# Megatron-LM's choices; the values not built yet are refused by validate_args (argument_validation).
# Megatron-LM's choices; the values not built yet are refused by validate_args (argument_validation).
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")


OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")


TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)


CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")


FLAG_TABLES = MODEL_FLAG_TABLES + RUN_FLAG_TABLES + SERVICE_FLAG_TABLES
"""Every Megatron-LM flag this project does not implement, with what setting it does here (arguments_support)."""


# Megatron-LM's flags that no longer work, and what to use instead (validate_args names the replacement).
DEPRECATED_FLAGS = {
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction",
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--checkpoint-activations": "--recompute-activations, or --recompute-granularity with --recompute-method",
}


def _layer_pattern(text: str, flag_kind: str):
    """An int N (every N-th layer) or a per-layer list written as a Python expression of int lists, ``*`` and
    ``+`` (``"([1]*3+[0])*2"``), evaluated without ``eval``."""

    def evaluate(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [evaluate(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(node)

    try:
        result = evaluate(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {flag_kind} pattern: give an integer or a list expression such as '([1]*3+[0])*2'"
        ) from None
    if not isinstance(result, (int, list)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a {flag_kind} pattern")
    return result


@public_api("megatron.training.arguments")
def moe_freq_type(x):
    """``--moe-layer-freq``: every N-th layer is an MoE layer (int), or one 0/1 per layer (list expression)."""
    return _layer_pattern(x, "layer frequency")


@public_api("megatron.training.arguments")
def la_freq_type(x):
    """``--linear-attention-freq``: every N-th layer uses linear attention (int), or one 0/1 per layer (list)."""
    return _layer_pattern(x, "linear-attention frequency")


@public_api("megatron.training.arguments")
def no_rope_freq_type(x):
    """``--no-rope-freq``: every N-th layer has no rotary embedding (int), or one 0/1 per layer (list)."""
    return _layer_pattern(x, "no-rope frequency")


@public_api("megatron.training.arguments")
def tuple_type(x):
    """``--window-size``: ``"(left, right)"`` or ``"left,right"`` -> a tuple of ints (-1: unbounded)."""
    try:
        parts = [int(part) for part in str(x).strip().strip("()").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{x!r} is not a tuple of integers such as '(128, 0)'") from None
    return tuple(parts)


def _parse_cuda_graph_modules_arg(x):
    """``--cuda-graph-modules``: one module name (CUDA graphs have no effect here, so any name is accepted)."""
    return str(x)


NAMED_TYPES = {
    function.__name__: function
    for function in (moe_freq_type, la_freq_type, no_rope_freq_type, tuple_type, _parse_cuda_graph_modules_arg)
}


# The few flags whose dashed name is not their dest's (Megatron-LM spells them differently).
_FLAG_NAMES = {"microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage"}


def flag_for(dest: str) -> str:
    """The command-line flag that sets ``dest``, for error messages that name what the user typed."""
    return _FLAG_NAMES.get(dest, "--" + dest.replace("_", "-"))
