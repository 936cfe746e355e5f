"""Packaging for megatron_p2r.

torch is a range on purpose: the Makefile installs the pinned CPU wheel first, so pip
never pulls a multi-GB CUDA build on a machine that already has a suitable torch.
"""

from setuptools import find_packages, setup

setup(
    name="megatron_p2r",
    version="0.1.0",
    description="Pseudo-to-Real pretraining of giant transformer LMs with TP/PP/EP/DP",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_p2r", "megatron_p2r.*", "tools", "tools.*"]),
    py_modules=["pretrain_m6"],
    package_data={
        "megatron_p2r.optim": ["host_kernels.cpp"],  # compiled on first use (optim/host_kernels.py)
        "megatron_p2r.config": ["megatron_parser.json"],
    },  # Megatron-LM's parser, as a table
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "regex",
        "safetensors",
        "tqdm",
        "pyyaml",
        "tensorboard",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-timeout",
            "ruff",
            "tokenizers",
            "transformers",
            "matplotlib",
            "hypothesis",
            "tiktoken",
        ],
        "plot": ["matplotlib"],
        "hf": ["transformers"],
        "tiktoken": ["tiktoken"],
        "wandb": ["wandb"],
        "bench": ["transformers", "tokenizers"],
        "dev": ["pytest", "pytest-timeout", "ruff"],
    },
    entry_points={
        "console_scripts": [
            "p2r-pretrain=pretrain_m6:main",
            "p2r-convert-checkpoint=tools.convert_checkpoint:main",
            "p2r-preprocess-data=tools.preprocess_data:main",
            "p2r-train-tokenizer=tools.train_tokenizer:main",
            "p2r-plan=tools.plan:main",
            "p2r-study=tools.p2r_study.cli:main",
        ]
    },
)
