"""Text generation with Megatron models: sampling parameters, requests, KV-cache contexts, the model wrapper, the
token-generating controller, the static and dynamic (continuous-batching) engines and the offline ``MegatronLLM``.

How the pieces stack (each layer only calls the one below it)::

    MegatronLLM.generate / a server          apis/llm.py, text_generation_server/
      DynamicInferenceEngine / StaticInferenceEngine     engines/  (scheduling, requests, futures, streaming)
        TextGenerationController             text_generation_controllers/  (one step: forward, sample, stop)
          GPTInferenceWrapper                model_inference_wrappers/  (inputs, TP gather, PP send/recv)
            GPTModel(..., inference_context=context)   attention reads/writes the KV cache in the context
              StaticInferenceContext / DynamicInferenceContext   contexts/  (the caches and their bookkeeping)
"""
