"""Extract, from each torch_npu wheel the `[npu*]` extras install, the schemas of the operators
epdserve calls, into tests/fixtures/torch_npu/<version>.txt (the fake torch_npu reads them).

    python scripts/npu_signatures.py            # all lines in LINES; needs PyPI (pip download)
    python scripts/npu_signatures.py 2.9.0      # one line

Only text is written (never the wheel). Where each schema lives in a wheel (read from the 2.8.0,
2.9.0 and 2.12.0 wheels):
- `npu::` operators: torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml, the `func:` lines
  (op-plugin's op_plugin/config/op_plugin_functions.yaml after codegen); torch_npu binds them as
  `torch_npu.<name> = torch.ops.npu.<name>` (torch_npu/utils/custom_ops.py);
- `atb::` operators: the `m.def("...")` strings of op-plugin op_plugin/ops/atb/*.cpp, compiled into
  torch_npu/lib/libop_plugin_atb.so (loaded by torch_npu/op_plugin/atb/_atb_ops.py at import,
  `torch.ops.load_library`), found here as the NUL-terminated strings of that library;
- the Ascend/pytorch commit the wheel was built from: torch_npu/version.py `git_version`;
- which of the torch_npu.npu names NPU decode graphs use the line exports: torch_npu/npu/__init__.py
  `__all__` (a comment line, "# torch_npu.npu exports: ...").
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# version -> (op-plugin branch, CANN), as setup.py's extras and Ascend/pytorch's release branches name them
LINES = {
    "2.8.0": ("7.2.0", "8.3.RC1"),
    "2.9.0": ("7.3.0", "8.5.0"),
    "2.12.0": ("26.1.0", "9.1.0"),
}
NPU_OPS = ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score",
           "npu_fused_infer_attention_score.out", "_npu_fused_infer_attention_score_get_max_workspace",  # decode graphs
           "npu_add_rms_norm", "npu_rms_norm", "npu_rotary_mul", "npu_apply_rotary_pos_emb", "npu_swiglu",  # + ops/npu_layer_ops.py
           "npu_weight_quant_batchmatmul", "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul",  # + engine/lm/npu_quant_linear.py
           "npu_convert_weight_to_int4pack")  # + engine/lm/npu_int4_linear.py
ATB_OPS = ("_npu_reshape_and_cache",)
# torch_npu.npu names the decode graphs use (epdserve/platform/npu_graphs.py GRAPH_API), looked up in
# torch_npu/npu/__init__.py's `__all__`
NPU_EXPORTS = ("NPUGraph", "graph", "graph_pool_handle", "ExternalEvent", "Stream", "graph_task_group_begin",
               "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end")
NPU_INIT = "torch_npu/npu/__init__.py"
CODEGEN_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
ATB_LIB = "torch_npu/lib/libop_plugin_atb.so"
VERSION_PY = "torch_npu/version.py"
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "torch_npu"


def download(version: str, into: Path) -> Path:
    """The manylinux x86_64 wheel for this interpreter (the schemas do not depend on the CPU or the Python)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into),
                    f"torch-npu=={version}"], check=True)
    (wheel,) = into.glob(f"torch_npu-{version}-*.whl")
    return wheel


def npu_schemas(codegen_yaml: str, names) -> dict[str, str]:
    """`func:` lines of the codegen yaml (an overload as `name.overload`); an operator listed twice
    (op_api and aclnn) must agree."""
    found: dict[str, str] = {}
    for m in re.finditer(r"func: (([\w.]+)\(.*\) -> .*)$", codegen_yaml, re.M):
        schema, name = m.group(1).strip(), m.group(2)
        if name in names:
            if found.setdefault(name, schema) != schema:
                raise SystemExit(f"{name}: two different schemas in {CODEGEN_YAML}")
    return found


def atb_schemas(library: bytes, names) -> dict[str, str]:
    """The first NUL-terminated string `<name>(...) -> ...` in the library, per name."""
    found: dict[str, str] = {}
    for name in names:
        m = re.search(rb"\x00(" + re.escape(name.encode()) + rb"\([ -~]*\) -> [ -~]*)\x00", library)
        if m:
            found[name] = m.group(1).decode("ascii")
    return found


def npu_exports(init_py: str) -> set[str]:
    """The names in torch_npu/npu/__init__.py's `__all__`."""
    import ast

    for node in ast.parse(init_py).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def extract(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        codegen = z.read(CODEGEN_YAML).decode()
        atb = z.read(ATB_LIB)
        git_version = re.search(r"git_version = '(\w+)'", z.read(VERSION_PY).decode()).group(1)
        exports = npu_exports(z.read(NPU_INIT).decode())
    npu, atb_found = npu_schemas(codegen, NPU_OPS), atb_schemas(atb, ATB_OPS)
    version = wheel.name.split("-")[1]
    op_plugin, cann = LINES[version]
    lines = [f"# torch_npu {version}: op-plugin {op_plugin}, CANN {cann}",
             f"# wheel: {wheel.name} sha256 {hashlib.sha256(wheel.read_bytes()).hexdigest()}",
             f"# built from Ascend/pytorch {git_version} ({VERSION_PY} git_version)",
             f"# npu:: schemas from {CODEGEN_YAML}; atb:: from the m.def strings in {ATB_LIB}",
             "# written by scripts/npu_signatures.py; an operator this line lacks is absent",
             f"# torch_npu.npu exports: {' '.join(n for n in NPU_EXPORTS if n in exports)}"]
    lines += [f"npu::{npu[n]}" for n in NPU_OPS if n in npu]
    lines += [f"atb::{atb_found[n]}" for n in ATB_OPS if n in atb_found]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(LINES), help="torch_npu versions (default: all)")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for version in args.versions:
            text = extract(download(version, Path(tmp)))
            (args.out / f"{version}.txt").write_text(text)
            schemas = sum(1 for line in text.splitlines() if not line.startswith("#"))
            print(f"{version}: {schemas} schemas -> {args.out / f'{version}.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
