from setuptools import find_packages, setup

setup(
    name="megatron-lite",
    version="0.1.0",
    description=(
        "Megatron-Core and Megatron-LM's public API, rebuilt to run and be tested on CPU (gloo) and GPU (nccl)."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron.training.builtin_data": ["*.json", "*.txt", "*.gz", "*.bin", "*.idx", "*.md"]},
    install_requires=["torch>=2.4", "numpy", "pyyaml", "crc32c"],
    extras_require={
        "test": [
            "pytest>=7",
            "tokenizers",
            "sentencepiece",
            "tiktoken",
            "regex",
            "fastapi",
            "uvicorn",
            "jinja2",
            "httpx",
            "openai",
            "safetensors",
            "transformers",
            "torchao",  # independent FP8 / MX quantisation references for the FP8 tests
            "triton",  # the kernels' tests: interpreter runs and ahead-of-time GPU compiles, no GPU needed
        ],
        "tokenizers": ["tokenizers", "sentencepiece", "tiktoken"],
        "gpu": ["triton"],
        "logging": ["tensorboard", "wandb"],
        "inference": ["fastapi", "uvicorn", "jinja2"],
        "huggingface": ["safetensors"],
    },
)
