"""Mamba-2 (state-space) layers of hybrid models: the mixer, the layer around it and the SSD scan.

``mamba_mixer.MambaMixer`` and ``mamba_layer.MambaLayer`` have Megatron-Core 0.19's signatures and checkpoint keys;
``ssd_chunked.ssd_chunked_scan`` is the pure-PyTorch scan (the reference, any device); ``ssd_kernels`` holds the
optional mamba-ssm / causal-conv1d kernels behind one import guard.
"""
