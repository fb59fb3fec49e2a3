"""The paged-KV operators of one torch_npu line, for the fake torch_npu: each operator has exactly
the schema that line's wheel registers (tests/fixtures/torch_npu/<version>.txt, written by
scripts/npu_signatures.py) and binds a call as torch does, so a keyword the line lacks fails as
it would on the device. Tests only.

What is copied from where:
- binding: torch's createStackForSchema (torch/csrc/jit/python/pybind_utils.h), what an
  `OpOverloadPacket` call runs: a RuntimeError (not TypeError) "Unknown keyword argument ...",
  "... is missing value for argument ...", "... takes N positional argument(s) ...";
  tests/ops/test_npu_kernel_lines.py checks these against torch's own dispatcher; a torch.dtype
  given for an `int` or `ScalarType` argument (both IntType to the JIT) arrives as its
  c10::ScalarType number (toIValue: a THPDtype is taken as its scalar_type);
- `torch_npu.<op>` is `torch.ops.npu.<op>` (torch_npu/utils/custom_ops.py on 2.8.0, 2.9.0,
  2.12.0); `torch_npu._npu_reshape_and_cache` is a lazy wrapper calling `torch.ops.atb.<op>`
  (torch_npu/op_plugin/atb/_atb_ops.py create_lazy_atb_function), and where
  lib/libop_plugin_atb.so did not load (no NNAL) `torch.ops.atb` lacks the op and the wrapper
  raises the saved OSError (`_register_atb_extensions`: `raise NNAL_EX from GLOBAL_E`);
- npu_scatter_pa_kv_cache: without a cache_mode keyword (op-plugin 7.2.0 / 7.3.0) it writes the
  NZ layout (ScatterPaKvCacheNpuOpApi.cpp `npu_scatter_pa_kv_cache`: `cache_mode = "PA_NZ"`);
  the NZ layout is [num_blocks, heads * head_dim // last, block_size, last] with last = 32 bytes
  (the op's golden test), the ND one ("Norm") [num_blocks, block_size, heads, head_dim];
- _npu_reshape_and_cache (op_plugin/ops/atb/ReshapeAndCachAtb.cpp): ND, int32 slot_indices.
"""
from __future__ import annotations

from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "torch_npu"
LINES = tuple(sorted((p.stem for p in FIXTURES.glob("*.txt")), key=lambda v: tuple(map(int, v.split(".")))))
NEWEST = LINES[-1]


def line_cann(line: str) -> str:
    """The CANN a line's wheel is built for, from its fixture's first line ("# torch_npu 2.8.0:
    op-plugin 7.2.0, CANN 8.3.RC1"; Ascend/pytorch COMPATIBILITY.en.md)."""
    head = (FIXTURES / f"{line}.txt").read_text().splitlines()[0]
    return head.rsplit("CANN", 1)[1].strip()


def refuses_tnd_paged(cann: str) -> bool:
    """Does this CANN's FIA refuse input_layout TND with a block table? Reported for CANN 8.3.RC1:
    vllm-ascend issue #4373 ("When layout is TND, not support Page Attention", vllm-ascend
    0.11.0rc1, whose README asks for CANN 8.3.RC1) and #8045 (torch-npu 2.8.0, built for 8.3.RC1:
    Ascend/pytorch COMPATIBILITY.en.md). vllm-ascend v0.13.0 (README: CANN 8.3.rc2, torch-npu
    2.8.0) makes this call for every step (attention_v1.py forward_fused_infer_attention), so
    8.3.RC2 takes it. A report, not a source: the engine's start-up check is what decides."""
    return cann.upper() == "8.3.RC1"


def tnd_paged_refused(impl):
    """FIA as a CANN that refuses TND + paged answers it: the aclnn call fails (error 561002)."""
    def refuse(a):
        if a["input_layout"] == "TND" and a["block_table"] is not None:
            raise RuntimeError("call aclnnFusedInferAttentionScoreV3 failed, error code is 561002: "
                               "When layout is TND, not support Page Attention")
        return impl(a)
    return refuse


def line_npu_exports(line: str) -> set[str]:
    """The torch_npu.npu names (of those decode graphs use) the line's wheel exports: the fixture's
    "# torch_npu.npu exports: ..." line (scripts/npu_signatures.py, from torch_npu/npu/__init__.py)."""
    prefix = "# torch_npu.npu exports:"
    for text in (FIXTURES / f"{line}.txt").read_text().splitlines():
        if text.startswith(prefix):
            return set(text[len(prefix):].split())
    return set()


def line_schemas(line: str) -> dict[str, torch._C.FunctionSchema]:
    """{"ns::name": schema} of the operators the line's wheel ships (comment lines skipped); an
    overload other than the default as "ns::name.overload"."""
    text = (FIXTURES / f"{line}.txt").read_text()
    schemas = [torch._C.parse_schema(s) for s in text.splitlines() if s and not s.startswith("#")]
    return {s.name + (f".{s.overload_name}" if s.overload_name else ""): s for s in schemas}


# c10/core/ScalarType.h's enum order (AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS), the dtypes used here
SCALAR_TYPES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
                torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.qint8: 12, torch.quint8: 13,
                torch.qint32: 14, torch.bfloat16: 15}
_DTYPE_OF = {v: k for k, v in SCALAR_TYPES.items()}


def dtype_of(value) -> torch.dtype | None:
    """The dtype an operator receives, whether its schema said ScalarType (a torch.dtype) or int."""
    return _DTYPE_OF[value] if isinstance(value, int) and not isinstance(value, bool) else value


def _ivalue(param, value):
    """A torch.dtype for an `int` / `ScalarType` argument becomes its ScalarType number, as torch binds it."""
    if isinstance(value, torch.dtype) and str(param.type) in ("int", "Optional[int]"):
        return SCALAR_TYPES[value]
    return value


def bind(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict:
    """{argument: value} as createStackForSchema binds a Python call, defaults filled in."""
    params = schema.arguments
    given = len(args) + len(kwargs)
    if given > len(params):
        raise RuntimeError(f"{schema.name}() expected at most {len(params)} argument(s) but received {given} "
                           f"argument(s). Declaration: {schema}")
    positional = sum(not p.kwarg_only for p in params)
    if len(args) > positional:
        raise RuntimeError(f"{schema.name}() takes {positional} positional argument(s) but {len(args)} was/were "
                           f"given.  Declaration: {schema}")
    bound = {p.name: a for p, a in zip(params, args)}
    consumed = 0
    for p in params[len(args):]:
        if p.name in kwargs:
            bound[p.name] = kwargs[p.name]
            consumed += 1
        elif p.has_default_value():
            bound[p.name] = p.default_value
        else:
            raise RuntimeError(f"{schema.name}() is missing value for argument '{p.name}'. Declaration: {schema}")
    if consumed != len(kwargs):
        names = {p.name for p in params}
        for k in kwargs:
            if k not in names:
                raise RuntimeError(f"Unknown keyword argument '{k}' for operator '{schema.name}'. Schema: {schema}")
            if k in {p.name for p in params[:len(args)]}:
                raise RuntimeError(f"Argument '{k}' specified both as positional and keyword argument. "
                                   f"Schema: {schema}")
    return {p.name: _ivalue(p, bound[p.name]) for p in params}


def run_now(name: str, impl, bound: dict):
    """A kernel launch outside any graph capture or task update: computed at once."""
    return impl(bound)


class FakeOverload:
    """`torch.ops.<ns>.<op>.<overload>`: `_schema` and the call, launched through `launch(name, impl,
    bound)` (`run_now`, or the graph stand-in's: tests/fakes/npu_graphs_fake.py)."""

    def __init__(self, schema, impl, record, launch=run_now):
        self._schema, self._impl, self._record, self._launch = schema, impl, record, launch
        self._name = schema.name.split("::")[1] + (f".{schema.overload_name}" if schema.overload_name else "")

    def __call__(self, *args, **kwargs):
        self._record(self._name, tuple(map(describe, args)), {k: describe(v) for k, v in kwargs.items()})
        return self._launch(self._name, self._impl, bind(self._schema, args, kwargs))


class FakeOpPacket(FakeOverload):
    """`torch.ops.<ns>.<op>` (an OpOverloadPacket: `default`, and `out` etc. where the line has them)."""

    def __init__(self, schema, impl, record, launch=run_now):
        super().__init__(schema, impl, record, launch)
        self.default = FakeOverload(schema, impl, record, launch)
        self._overloads = ["default"]

    def add_overload(self, overload: FakeOverload) -> None:
        setattr(self, overload._schema.overload_name, overload)
        self._overloads.append(overload._schema.overload_name)

    def overloads(self) -> list[str]:
        return list(self._overloads)


class FakeOpNamespace:
    """`torch.ops.<ns>`: an unregistered operator is an AttributeError, as _OpNamespace.__getattr__ raises."""

    def __init__(self, name: str, ops: dict[str, FakeOpPacket]):
        self._name, self._ops = name, ops

    def __getattr__(self, op: str):
        try:
            return self.__dict__["_ops"][op]
        except KeyError:
            raise AttributeError(f"'_OpNamespace' '{self._name}' object has no attribute '{op}'") from None


def namespaces(line: str, impls: dict, record, *, atb_loaded: bool = True,
               absent: tuple[str, ...] = (), launch=run_now) -> dict[str, FakeOpNamespace]:
    """{"npu": ..., "atb": ...}: the line's operators, computed by `impls[name]` (`impls["name.out"]`
    for an overload; a function of the bound arguments; an operator without one raises
    NotImplementedError when called); those named in `absent` left out (a line that does not
    register them)."""
    ops: dict[str, dict[str, FakeOpPacket]] = {"npu": {}, "atb": {}}
    schemas = line_schemas(line)
    for qualified, schema in sorted(schemas.items(), key=lambda kv: bool(kv[1].overload_name)):
        ns, name = qualified.split("::")
        if (ns == "atb" and not atb_loaded) or name in absent:
            continue
        impl = impls.get(name, _not_computed(name))
        if schema.overload_name:  # an overload joins its default's packet
            ops[ns][name.split(".")[0]].add_overload(FakeOverload(schema, impl, record, launch))
        else:
            ops[ns][name] = FakeOpPacket(schema, impl, record, launch)
    return {ns: FakeOpNamespace(ns, table) for ns, table in ops.items()}


def module_attributes(ns: dict[str, FakeOpNamespace]) -> dict:
    """What torch_npu's import binds: `torch_npu.<op> = torch.ops.npu.<op>` (custom_ops.py) and the
    lazy ATB wrappers (_atb_ops.py `_patch_atb_and_loadso`)."""
    attrs = dict(ns["npu"]._ops)

    def _npu_reshape_and_cache(*args, **kwargs):
        if "_npu_reshape_and_cache" not in ns["atb"]._ops:  # the saved OSError of the failed load_library
            raise OSError("Please check that the nnal package is installed. "
                          "Please run 'source set_env.sh' in the NNAL installation path.")
        return ns["atb"]._npu_reshape_and_cache(*args, **kwargs)

    attrs["_npu_reshape_and_cache"] = _npu_reshape_and_cache
    return attrs


def describe(v):
    """A tensor as (dtype, shape, contiguous); anything else as itself."""
    return (v.dtype, tuple(v.shape), v.is_contiguous()) if isinstance(v, torch.Tensor) else v


def _not_computed(name):
    def impl(bound):
        raise NotImplementedError(f"the fake torch_npu computes no {name}: pass it in kernels=")
    return impl


def _require(cond, msg):
    if not cond:
        raise RuntimeError(msg)  # what a failed tiling/parameter check surfaces as


def scatter_pa_kv_cache(a: dict) -> None:
    """npu_scatter_pa_kv_cache, scenarios one/two (no compression): ND under "Norm", NZ under "PA_NZ"
    (the keyword's default, and the hard-coded mode where the line has no keyword)."""
    _require(a["slot_mapping"].dtype in (torch.int32, torch.int64), "slot_mapping int32/int64")
    _require(a["compress_lens"] is None and a["seq_lens"] is None, "stand-in covers scenario one/two")
    _scatter(a, "slot_mapping", a.get("cache_mode", "PA_NZ"))


def reshape_and_cache_atb(a: dict) -> None:
    _require(a["slot_indices"].dtype == torch.int32, "ATB ReshapeAndCache takes int32 slots")
    _scatter(a, "slot_indices", "Norm")


KV_WRITES = {"npu_scatter_pa_kv_cache": scatter_pa_kv_cache, "_npu_reshape_and_cache": reshape_and_cache_atb}


def _scatter(a, slot_key, cache_mode):
    key, value, kc, vc, slots = a["key"], a["value"], a["key_cache"], a["value_cache"], a[slot_key]
    _require(key.dtype in (torch.float16, torch.bfloat16, torch.int8), "A2/A3 take fp16/bf16/int8")
    _require(key.dtype == value.dtype == kc.dtype == vc.dtype, "dtypes must match")
    _require(all(t.is_contiguous() for t in (key, value, kc, vc, slots)), "non-contiguous input")
    _require(key.dim() == 3 and kc.dim() == 4, "stand-in covers 3-D key/value and 4-D caches")
    T, n, d = key.shape
    if cache_mode == "Norm":  # ND: [num_blocks, block_size, heads, head_dim]
        _require(tuple(kc.shape[2:]) == (n, d) and vc.shape == kc.shape, "ND cache shape")
        bs = kc.shape[1]
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s // bs, s % bs] = key[i]
                vc[s // bs, s % bs] = value[i]
    elif cache_mode == "PA_NZ":  # NZ, as the op's golden: [num_blocks, heads * head_dim // last, block_size, last]
        last = 32 // key.element_size()
        _require(kc.shape[3] == last and kc.shape[1] == n * d // last, "NZ cache shape")
        bs = kc.shape[2]
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s // bs, :, s % bs] = key[i].reshape(-1, last)
                vc[s // bs, :, s % bs] = value[i].reshape(-1, last)
    else:
        raise RuntimeError(f"cache_mode {cache_mode!r}")
