"""Turning a model's logits into generated tokens, one forward step at a time.

The controller runs a forward step through the model wrapper, samples every request's next token on the last
pipeline stage, broadcasts the tokens (and their log-probs) to the other stages so all ranks keep the same
bookkeeping, and decides when a request is done (termination id, stop string, length).

Two drivers use it:

* the static engine: :meth:`TextGenerationController.generate_all_output_tokens_static_batch` runs a padded batch
  to completion with a :class:`StaticInferenceContext` (prefill up to the shortest prompt, then one position per
  step for every row; rows whose prompt is longer keep their prompt token until their prompt ends);
* the dynamic engine: it plans a step (which requests, how many tokens each) into
  :attr:`TextGenerationController.dynamic_step` and calls
  :meth:`TextGenerationController.generate_output_tokens_dynamic_batch`.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.sampling import sample
from megatron.core.utils import get_attr_wrapped_model


_NO_DRAW = SamplingParams(top_k=1)  # stands in for a row whose sample is not used


@dataclass
class DynamicStep:
    """One step planned by the dynamic engine: the requests in the order of the context's chunks, how many
    tokens each brings, and which of them get a new token from this step (their prompt is complete after it)."""

    requests: List[Any]
    chunk_lengths: List[int]
    samples: List[bool]
    prompt_log_prob_targets: Optional[List[int]] = None  # next prompt token of every token of the step, or -1


@dataclass
class StepTokens:
    """What one step produced, identical on every rank: per request of the step its token, log-prob and top-n."""

    tokens: List[int]
    log_probs: List[float]
    top_n: Optional[List[Tuple[List[int], List[float]]]] = None
    token_log_probs: Optional[List[float]] = None  # per token of the step: log-prob of its next prompt token


class TextGenerationController:
    """Generates tokens with ``inference_wrapped_model`` (e.g. a GPTInferenceWrapper) and ``tokenizer``.

    The tokenizer must offer ``tokenize``, ``detokenize`` and ``eod`` (Megatron's tokenizers do); its
    ``vocab_size`` bounds sampling, so padded vocabulary rows of the model are never chosen.
    """

    def __init__(self, inference_wrapped_model, tokenizer):
        self.inference_wrapped_model = inference_wrapped_model
        self.tokenizer = tokenizer
        self.model_config = inference_wrapped_model.config
        model = inference_wrapped_model.model
        self.max_sequence_length = get_attr_wrapped_model(model, "max_sequence_length")
        device = next(iter(model.parameters())).device
        self.sampling_rng = torch.Generator(device=device)
        self.sampling_rng.manual_seed(1234)
        self._request_generators: Dict[Any, torch.Generator] = {}
        self._stop_word_finished_ids_callback: Optional[Callable] = None
        self.dynamic_step: Optional[DynamicStep] = None
        self.vocab_size = getattr(tokenizer, "vocab_size", None)

    # ---- tokens and text ----

    @staticmethod
    def tokenize_prompt(tokenizer, prompt: str, add_BOS: bool = False) -> List[int]:
        tokens = list(tokenizer.tokenize(prompt))
        if add_BOS:
            bos = getattr(tokenizer, "bos", None)
            if bos is None:
                raise ValueError("add_BOS=True but the tokenizer has no BOS token")
            tokens = [bos] + tokens
        return tokens

    @staticmethod
    def detokenize(tokenizer, tokens: List[int], remove_EOD: bool = True, skip_special_tokens: bool = True) -> str:
        """Text of ``tokens``; with ``remove_EOD`` end-of-document tokens are left out. ``skip_special_tokens``
        is passed to tokenizers whose ``detokenize`` takes it."""
        tokens = [int(t) for t in tokens]
        if remove_EOD:
            eod = getattr(tokenizer, "eod", None)
            tokens = [t for t in tokens if t != eod]
        return tokenizer.detokenize(tokens)

    def detokenize_generations(
        self,
        tokens_gpu_tensor: torch.Tensor,
        lengths_gpu_tensor: torch.Tensor,
        detokenize_segments: bool,
        skip_special_tokens: bool = True,
    ) -> Tuple[str, Optional[List[List[str]]]]:
        """Text of the first ``lengths`` tokens of a row, and with ``detokenize_segments`` each token's text."""
        tokens = tokens_gpu_tensor.tolist()[: int(lengths_gpu_tensor)]
        text = self.detokenize(self.tokenizer, tokens, skip_special_tokens=skip_special_tokens)
        segments = [self.tokenizer.detokenize([t]) for t in tokens] if detokenize_segments else None
        return text, segments

    def set_stop_word_finished_ids_callback(self, callback) -> None:
        """``callback(request_ids)`` is called with the ids of requests a stop string finished."""
        self._stop_word_finished_ids_callback = callback

    # ---- padding (the static batch) ----

    def pad_input_prompt_tokens(
        self, batch_prompt_tokens_list: List[List[int]], padded_batch_size: int, padded_sequence_length: int
    ) -> torch.Tensor:
        """``[padded_batch_size, padded_sequence_length]`` of the prompts, padded with the EOD id."""
        pad = getattr(self.tokenizer, "eod", 0)
        device = next(iter(self.inference_wrapped_model.model.parameters())).device
        tokens = torch.full((padded_batch_size, padded_sequence_length), pad, dtype=torch.long, device=device)
        for row, prompt in enumerate(batch_prompt_tokens_list):
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        return tokens

    def unpad_input_prompt_tokens(self, padded_batch_prompt_tokens: torch.Tensor, original_batch_size: int):
        return padded_batch_prompt_tokens[:original_batch_size]

    def prep_inference_input(
        self,
        prompts_tokens: torch.Tensor,
        active_requests: "OrderedDict[int, InferenceRequest]",
        use_attention_mask: bool = False,
    ) -> Dict[str, Any]:
        """The wrapper's inputs for the padded batch (causal masking comes from the context, not a mask)."""
        if use_attention_mask:
            raise ValueError("use_attention_mask=True is not needed: the KV-cache context applies causal masking")
        return self.inference_wrapped_model.prep_inference_input(prompts_tokens)

    def update_generation_status(
        self,
        updated_prompts_tokens: torch.Tensor,
        generation_started: torch.Tensor,
        current_context_end_position: int,
        is_generation_done_tensor: torch.Tensor,
        generated_sequence_lengths: torch.Tensor,
        termination_id: Optional[int] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Mark rows whose token at ``current_context_end_position`` is the termination id as done, and count
        one more generated token for rows that were generating and not done (Megatron's static-batch helper)."""
        termination_id = self.tokenizer.eod if termination_id is None else termination_id
        latest = updated_prompts_tokens[:, current_context_end_position]
        counting = generation_started & ~is_generation_done_tensor
        generated_sequence_lengths = generated_sequence_lengths + counting.long()
        is_generation_done_tensor = is_generation_done_tensor | (counting & (latest == termination_id))
        return is_generation_done_tensor, generated_sequence_lengths

    # ---- sampling ----

    def _generator_for(self, request) -> Optional[torch.Generator]:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.sampling_rng.device)
            generator.manual_seed(seed)
            self._request_generators[request.request_id] = generator
        return generator

    def sample_from_logits(
        self,
        last_token_logits: torch.Tensor,
        sampling_params: Optional[SamplingParams] = None,
        vocab_size: Optional[int] = None,
        generation_started: Optional[torch.Tensor] = None,
        top_n_logprobs_dict: Dict[int, List[Dict[str, float]]] = None,
        logits: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """Next tokens ``[b]`` for ``last_token_logits`` ``[b, v]``, every row with ``sampling_params``.

        With ``top_n_logprobs_dict`` (a dict) and ``sampling_params.top_n_logprobs > 0``, row ``i``'s top-n
        ``{token text: log-prob}`` is appended to ``top_n_logprobs_dict[i]`` for rows whose generation started.
        """
        sampling_params = sampling_params or SamplingParams()
        rows = last_token_logits.shape[0]
        vocab_size = vocab_size if vocab_size is not None else self.vocab_size
        tokens = sample(last_token_logits, [sampling_params] * rows, [None] * rows, self.sampling_rng, vocab_size)
        if top_n_logprobs_dict is not None and sampling_params.top_n_logprobs > 0:
            log_probs = torch.log_softmax(last_token_logits.float()[:, :vocab_size], dim=-1)
            values, indices = log_probs.topk(sampling_params.top_n_logprobs, dim=-1)
            for i in range(rows):
                if generation_started is None or bool(generation_started[i]):
                    top_n_logprobs_dict.setdefault(i, []).append(
                        self._top_n_dict(indices[i].tolist(), values[i].tolist())
                    )
        return tokens

    def _top_n_dict(self, ids: Sequence[int], values: Sequence[float]) -> Dict[str, float]:
        return {self.tokenizer.detokenize([t]): v for t, v in zip(ids, values)}

    def _is_last_stage(self) -> bool:
        return not self.inference_wrapped_model.pipelined or self.inference_wrapped_model.post_process

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's ``tensor`` on every stage (same shape/dtype allocated everywhere)."""
        if self.inference_wrapped_model.pipelined:
            dist.broadcast(
                tensor,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return tensor

    def _sample_step(
        self,
        last_logits: Optional[torch.Tensor],
        requests: Sequence[Any],
        token_logits: Optional[torch.Tensor] = None,
        token_targets: Optional[List[int]] = None,
        draws: Optional[Sequence[bool]] = None,
    ) -> StepTokens:
        """Sample one token per request (rows of ``last_logits``) on the last stage and share them with every
        stage; with ``token_targets`` also the log-prob of each target under ``token_logits`` rows (prompt
        log-probs; -1 = no target). Rows with ``draws[i]`` False (a prompt chunk that does not end its prompt)
        take no sample, so they do not advance their request's random generator."""
        device = self.sampling_rng.device
        rows = len(requests)
        top_n = max((r.sampling_params.top_n_logprobs for r in requests), default=0)
        tokens = torch.empty(rows, dtype=torch.long, device=device)
        chosen = torch.empty(rows, dtype=torch.float32, device=device)
        top_values = torch.empty(rows, top_n, dtype=torch.float32, device=device)
        top_ids = torch.empty(rows, top_n, dtype=torch.long, device=device)
        target_lp = None
        if token_targets is not None:
            target_lp = torch.empty(len(token_targets), dtype=torch.float32, device=device)
        if self._is_last_stage():
            vocab = self.vocab_size or last_logits.shape[-1]
            draws = draws if draws is not None else [True] * rows
            params = [r.sampling_params if draw else _NO_DRAW for r, draw in zip(requests, draws)]
            generators = [self._generator_for(r) if draw else None for r, draw in zip(requests, draws)]
            tokens = sample(last_logits, params, generators, self.sampling_rng, vocab)
            if top_n or any(r.sampling_params.return_log_probs for r in requests):
                log_probs = torch.log_softmax(last_logits.float()[:, :vocab], dim=-1)
                chosen = log_probs.gather(-1, tokens[:, None])[:, 0]
                if top_n:
                    top_values, top_ids = log_probs.topk(top_n, dim=-1)
            else:
                chosen.zero_()  # nobody asked for log-probs (append_token keeps them only when asked)
            if token_targets is not None:
                targets = torch.tensor(token_targets, device=device)
                all_lp = torch.log_softmax(token_logits.float()[:, :vocab], dim=-1)
                target_lp = all_lp.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
        for t in (
            (tokens, chosen)
            + ((top_values, top_ids) if top_n else ())
            + ((target_lp,) if target_lp is not None else ())
        ):
            self._broadcast_from_last_stage(t)
        top = None
        if top_n:
            top = list(zip(top_ids.tolist(), top_values.tolist()))
        return StepTokens(
            tokens=tokens.tolist(),
            log_probs=chosen.tolist(),
            top_n=top,
            token_log_probs=None if target_lp is None else target_lp.tolist(),
        )

    # ---- request bookkeeping shared by both drivers ----

    def append_token(self, request, token: int, log_prob: float, top_n, max_new_tokens: int) -> bool:
        """Add a generated token to ``request``; True when the request is finished by it."""
        params = request.sampling_params
        request.generated_tokens.append(token)
        if params.return_log_probs:
            request.generated_log_probs = (request.generated_log_probs or []) + [log_prob]
        if params.top_n_logprobs and top_n is not None:
            ids, values = top_n
            entry = self._top_n_dict(ids[: params.top_n_logprobs], values[: params.top_n_logprobs])
            request.generated_top_n_logprobs = (request.generated_top_n_logprobs or []) + [entry]
        termination_id = params.termination_id if params.termination_id is not None else self.tokenizer.eod
        if token == termination_id or len(request.generated_tokens) >= max_new_tokens:
            return True
        if params.stop_words and self._stop_index(request) is not None:
            if self._stop_word_finished_ids_callback is not None:
                self._stop_word_finished_ids_callback([request.request_id])
            return True
        return False

    def _stop_index(self, request) -> Optional[Tuple[int, int]]:
        """``(start, length)`` of the earliest stop string in the generated text, or None."""
        text = self.detokenize(self.tokenizer, request.generated_tokens)
        found = [(text.find(w), len(w)) for w in request.sampling_params.stop_words if w in text]
        return min(found) if found else None

    def finish_request(self, request, status: Status = Status.COMPLETED) -> None:
        """Final text (without the termination token; cut at a stop string unless ``detokenize_stop_sequence``),
        length and status."""
        params = request.sampling_params
        termination_id = params.termination_id if params.termination_id is not None else self.tokenizer.eod
        tokens = request.generated_tokens
        if tokens and tokens[-1] == termination_id:
            tokens = tokens[:-1]
        text = self.detokenize(self.tokenizer, tokens)
        if params.stop_words:
            stop = self._stop_index(request)
            if stop is not None:
                start, length = stop
                text = text[: start + (length if params.detokenize_stop_sequence else 0)]
        request.generated_text = text
        request.generated_length = len(request.generated_tokens)
        if params.return_segments:
            request.generated_segments = [self.tokenizer.detokenize([t]) for t in request.generated_tokens]
        request.status = status
        self._request_generators.pop(request.request_id, None)

    # ---- the static batch ----

    def generate_all_output_tokens_static_batch(
        self,
        active_requests: "OrderedDict[int, InferenceRequest]",
        active_streams: Optional["OrderedDict[str, Any]"] = None,
    ) -> "OrderedDict[int, InferenceRequest]":
        """Run a batch of requests to completion with a static KV cache; returns them finished.

        ``active_streams`` (request id -> callable) is called with the request after each of its new tokens.
        """
        requests = list(active_requests.values())
        wrapper = self.inference_wrapped_model
        prompt_lengths = [len(r.prompt_tokens) for r in requests]
        budgets = []
        for request, length in zip(requests, prompt_lengths):
            if length < 1:
                raise ValueError(f"request {request.request_id}: the prompt has no tokens")
            budget = request.sampling_params.max_new_tokens(length, self.max_sequence_length)
            if budget < 0:
                raise ValueError(
                    f"request {request.request_id}: the prompt has {length} tokens, more than the model's "
                    f"max_sequence_length={self.max_sequence_length}; shorten it"
                )
            budgets.append(budget)
            request.generated_tokens = []
            request.status = Status.ACTIVE_AND_GENERATING_TOKENS
            if request.sampling_params.return_log_probs and not request.sampling_params.skip_prompt_log_probs:
                request.prompt_log_probs = []
        total_length = max(length + budget for length, budget in zip(prompt_lengths, budgets))
        tokens = self.pad_input_prompt_tokens([r.prompt_tokens for r in requests], len(requests), total_length)
        previous_context = wrapper.inference_context
        wrapper.inference_context = StaticInferenceContext(len(requests), total_length)
        wrapper.prep_model_for_inference()
        inference_input = wrapper.prep_inference_input(tokens)
        done = [budget == 0 for budget in budgets]
        want_prompt_lp = any(r.prompt_log_probs is not None for r in requests)
        context_start = 0
        try:
            for context_end in range(min(prompt_lengths), total_length):
                if all(done):
                    break
                window = wrapper.get_batch_for_context_window(inference_input, context_start, context_end)
                if not want_prompt_lp:  # only the window's last position predicts a token
                    window["logits_positions"] = torch.tensor([context_end - context_start - 1], device=tokens.device)
                logits = wrapper.run_one_forward_step(window)
                wrapper.inference_context.increment_sequence_len_offset(context_end - context_start)
                targets = flat_logits = None
                if want_prompt_lp:
                    # Position p's logits predict prompt token p + 1 while p + 1 is still inside the prompt.
                    targets = [
                        requests[i].prompt_tokens[p + 1] if p + 1 < prompt_lengths[i] else -1
                        for i in range(len(requests))
                        for p in range(context_start, context_end)
                    ]
                    if logits is not None:
                        flat_logits = logits.reshape(-1, logits.shape[-1])
                step = self._sample_step(None if logits is None else logits[:, -1], requests, flat_logits, targets)
                width = context_end - context_start
                # Rows past their prompt take the sampled token (one host-to-device copy for the whole column).
                column = [
                    step.tokens[i] if context_end >= prompt_lengths[i] else requests[i].prompt_tokens[context_end]
                    for i in range(len(requests))
                ]
                tokens[:, context_end] = torch.tensor(column, device=tokens.device)
                for i, request in enumerate(requests):
                    if want_prompt_lp and request.prompt_log_probs is not None:
                        row = step.token_log_probs[i * width : (i + 1) * width]
                        request.prompt_log_probs.extend(
                            v for v, tgt in zip(row, targets[i * width : (i + 1) * width]) if tgt >= 0
                        )
                    if done[i] or context_end < prompt_lengths[i]:
                        continue
                    token = step.tokens[i]
                    top = step.top_n[i] if step.top_n is not None else None
                    done[i] = self.append_token(request, token, step.log_probs[i], top, budgets[i])
                    if active_streams is not None and request.request_id in active_streams:
                        active_streams[request.request_id](request)
                context_start = context_end
        finally:
            wrapper.inference_context = previous_context
        for request in requests:
            self.finish_request(request)
        return active_requests

    # ---- the dynamic batch ----

    def generate_output_tokens_dynamic_batch(self, loop=None) -> Optional[Dict]:
        """Run the step the dynamic engine planned in :attr:`dynamic_step` over the dynamic context it
        prepared; returns ``{"step": StepTokens}`` (identical on every rank), or None when nothing was planned.
        ``loop`` is accepted for Megatron's signature; the step runs synchronously."""
        plan = self.dynamic_step
        if plan is None:
            return None
        self.dynamic_step = None
        wrapper = self.inference_wrapped_model
        context = wrapper.inference_context
        input_ids, position_ids, last_index = context.step_inputs
        inputs = {"tokens": input_ids, "position_ids": position_ids, "attention_mask": None}
        all_logits = plan.prompt_log_prob_targets is not None or not context.materialize_only_last_token_logits
        if not all_logits:
            inputs["logits_positions"] = last_index
        logits = wrapper.run_one_forward_step(inputs)
        context.commit_step()
        last_logits = flat_logits = None
        if logits is not None:
            flat_logits = logits[0]
            last_logits = flat_logits[last_index] if all_logits else flat_logits
        step = self._sample_step(last_logits, plan.requests, flat_logits, plan.prompt_log_prob_targets, plan.samples)
        return {"step": step}

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """A one-token forward that touches no request (warms up kernels and allocators); every pipeline stage
        must call it together."""
        wrapper = self.inference_wrapped_model
        previous = wrapper.inference_context
        wrapper.inference_context = StaticInferenceContext(1, 1)
        try:
            wrapper.prep_model_for_inference()
            device = self.sampling_rng.device
            tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
            wrapper.run_one_forward_step(wrapper.prep_inference_input(tokens))
        finally:
            wrapper.inference_context = previous
