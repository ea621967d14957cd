"""Text tokenizers' helpers at Megatron-Core's path (``megatron.core.tokenizers.text``): the parsers that split a
generated text into its answer and the reasoning or tool calls in it."""
