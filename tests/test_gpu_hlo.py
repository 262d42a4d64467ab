"""The XLA:GPU HLO reader (``jaxamp.diagnostics._hlo``) on handwritten GPU-HLO samples (CPU
only).

The samples follow what XLA:GPU emits: cuBLAS/cuBLASLt GEMMs are ``custom-call``s with
``custom_call_target="__cublas$gemm"`` / ``"__cublas$lt$matmul"`` returning ``(out,
s8[workspace])`` and a ``gemm_backend_config``; Triton GEMMs are ``kind=kCustom`` fusions with
``"fusion_backend_config":{"kind":"__triton_gemm"}`` whose ``dot`` sits in the called
computation; cuDNN calls are ``"__cudnn$..."`` custom-calls. ``tests/test_gpu.py`` runs the same
reader on the example's real compiled train step on a GPU.
"""

from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxamp.diagnostics._hlo import (
    f32_dot_signatures,
    find_gemms,
    fusion_kind,
    gemm_signature,
    host_traffic,
    kernels,
    parse_hlo,
    summarize,
    tensor_core_violations,
)

ROOT = Path(__file__).resolve().parent.parent

GEMM_CONFIG = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
               '"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,'
               '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
               '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
               '"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT",'
               '"DEFAULT"],"algorithm":"ALG_UNSET"},"epilogue":"DEFAULT","lhs_stride":"6291456",'
               '"rhs_stride":"1769472","grad_x":false,"grad_y":false,"damax_output":false},'
               '"force_earliest_schedule":false}')


def module(*computations: str) -> str:
    return "HloModule jit_step, is_scheduled=true\n\n" + "\n\n".join(computations) + "\n"


def entry(*lines: str, name: str = "main.42") -> str:
    return f"ENTRY %{name} (p0: bf16[8192,768], p1: bf16[768,2304]) -> bf16[8192,2304] {{\n" \
        + "\n".join("  " + ln for ln in lines) + "\n}"


# One line per instruction, operand shapes printed inline (compiled HLO of a jitted step).
CUBLASLT_BF16 = module(entry(
    "%p0 = bf16[8192,768]{1,0} parameter(0)",
    "%p1 = bf16[768,2304]{1,0} parameter(1)",
    "%custom-call.7 = (bf16[8192,2304]{1,0}, s8[4194304]{0}) custom-call(bf16[8192,768]{1,0} "
    "%p0, bf16[768,2304]{1,0} %p1), custom_call_target=\"__cublas$lt$matmul\", "
    + GEMM_CONFIG,
    "ROOT %get-tuple-element.3 = bf16[8192,2304]{1,0} get-tuple-element((bf16[8192,2304]{1,0}, "
    "s8[4194304]{0}) %custom-call.7), index=0"))

# Names only (no operand shapes): the reader resolves them from the computation.
CUBLAS_F16_NAMES = module(entry(
    "%p0 = f16[8192,768]{1,0} parameter(0)",
    "%p1 = f16[768,2304]{1,0} parameter(1)",
    "%custom-call.2 = (f16[8192,2304]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), "
    "custom_call_target=\"__cublas$gemm\", " + GEMM_CONFIG,
    "ROOT %gte = f16[8192,2304]{1,0} get-tuple-element(%custom-call.2), index=0"))

# A float32 GEMM through cuBLAS (TF32 at best): not f16/bf16.
CUBLAS_F32 = CUBLAS_F16_NAMES.replace("f16[", "f32[")

# XLA's test style: the instruction and its backend config spread over several lines, a
# closing brace alone on a line inside the config.
CUBLASLT_MULTILINE = """HloModule jit_slice

ENTRY %main.9 {
  %p0 = bf16[2,8,8]{2,1,0} parameter(0)
  %p1 = bf16[2,8,8]{2,1,0} parameter(1)
  %slice.13 = bf16[1,8,8]{2,1,0} slice(%p0), slice={[1:2], [0:8], [0:8]}
  %bitcast.41 = bf16[8,8]{1,0} bitcast(%slice.13)
  %slice.14 = bf16[1,8,8]{2,1,0} slice(%p1), slice={[1:2], [0:8], [0:8]}
  %bitcast.42 = f32[8,8]{1,0} bitcast(%slice.14)
  ROOT %custom-call.1 = (bf16[8,8]{1,0}, s8[4194304]{0}) custom-call(%bitcast.41, %bitcast.42),
    custom_call_target="__cublas$lt$matmul",
    backend_config={"gemm_backend_config":{
      "alpha_real":1,
      "beta":0,
      "dot_dimension_numbers":{
        "lhs_contracting_dimensions":["1"],
        "rhs_contracting_dimensions":["0"]
      },
      "epilogue":"DEFAULT"
    }
    }
}
"""

# A dot XLA left in a loop fusion: no library, no Tensor Cores.
PLAIN_DOT_IN_FUSION = module(
    "%fused_dot (param_0: bf16[64,32], param_1: bf16[32,16]) -> bf16[64,16] {\n"
    "  %param_0 = bf16[64,32]{1,0} parameter(0)\n"
    "  %param_1 = bf16[32,16]{1,0} parameter(1)\n"
    "  ROOT %dot.3 = bf16[64,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={0}\n}",
    "ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {\n"
    "  %a = bf16[64,32]{1,0} parameter(0)\n"
    "  %b = bf16[32,16]{1,0} parameter(1)\n"
    "  ROOT %loop_fusion = bf16[64,16]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused_dot\n}")

# A Triton GEMM: float32 params converted to bf16 inside the fusion, bf16 dot.
TRITON_GEMM = module(
    "%gemm_fusion_dot.5_computation (parameter_0: f32[768,3072], parameter_1: bf16[8192,768]) "
    "-> bf16[8192,3072] {\n"
    "  %parameter_0 = f32[768,3072]{1,0} parameter(0)\n"
    "  %convert.1 = bf16[768,3072]{1,0} convert(f32[768,3072]{1,0} %parameter_0)\n"
    "  %parameter_1 = bf16[8192,768]{1,0} parameter(1)\n"
    "  ROOT %dot.1 = bf16[8192,3072]{1,0} dot(bf16[8192,768]{1,0} %parameter_1, "
    "bf16[768,3072]{1,0} %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}",
    "ENTRY %main (w: f32[768,3072], x: bf16[8192,768]) -> bf16[8192,3072] {\n"
    "  %w = f32[768,3072]{1,0} parameter(0)\n"
    "  %x = bf16[8192,768]{1,0} parameter(1)\n"
    "  ROOT %gemm_fusion_dot.5 = bf16[8192,3072]{1,0} fusion(f32[768,3072]{1,0} %w, "
    "bf16[8192,768]{1,0} %x), kind=kCustom, calls=%gemm_fusion_dot.5_computation, "
    "backend_config={\"operation_queue_id\":\"0\",\"fusion_backend_config\":{\"kind\":"
    "\"__triton_gemm\",\"triton_gemm_config\":{\"block_m\":\"128\",\"block_n\":\"256\","
    "\"block_k\":\"64\",\"split_k\":\"1\",\"num_stages\":\"4\",\"num_warps\":\"8\","
    "\"num_ctas\":\"1\"}}}\n}")

# Newer XLA: the Triton GEMM as nested fusions; the f32 -> bf16 convert lives in a "block"
# fusion that feeds the dot, so the dot's operand types are those block fusions' results.
NESTED_TRITON = module(
    "%convert_computation (p: f32[768,3072]) -> bf16[768,3072] {\n"
    "  %p = f32[768,3072]{1,0} parameter(0)\n"
    "  ROOT %c = bf16[768,3072]{1,0} convert(%p)\n}",
    "%param_computation (q: bf16[8192,768]) -> bf16[8192,768] {\n"
    "  ROOT %q = bf16[8192,768]{1,0} parameter(0)\n}",
    "%gemm_fusion_dot.1_computation (parameter_0: f32[768,3072], parameter_1: bf16[8192,768]) "
    "-> bf16[8192,3072] {\n"
    "  %parameter_0 = f32[768,3072]{1,0} parameter(0)\n"
    "  %block_fusion = bf16[768,3072]{1,0} fusion(%parameter_0), kind=kCustom, "
    "calls=%convert_computation, backend_config={\"fusion_backend_config\":{\"kind\":"
    "\"__triton_nested_gemm_fusion\",\"block_level_fusion_config\":{\"output_tiles\":"
    "[{\"sizes\":[\"64\",\"256\"]}]}}}\n"
    "  %parameter_1 = bf16[8192,768]{1,0} parameter(1)\n"
    "  %block_fusion.1 = bf16[8192,768]{1,0} fusion(%parameter_1), kind=kCustom, "
    "calls=%param_computation, backend_config={\"fusion_backend_config\":{\"kind\":"
    "\"__triton_nested_gemm_fusion\"}}\n"
    "  ROOT %dot.2 = bf16[8192,3072]{1,0} dot(%block_fusion.1, %block_fusion), "
    "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}",
    "ENTRY %main (w: f32[768,3072], x: bf16[8192,768]) -> bf16[8192,3072] {\n"
    "  %w = f32[768,3072]{1,0} parameter(0)\n"
    "  %x = bf16[8192,768]{1,0} parameter(1)\n"
    "  ROOT %gemm_fusion_dot.1 = bf16[8192,3072]{1,0} fusion(%w, %x), kind=kCustom, "
    "calls=%gemm_fusion_dot.1_computation, backend_config={\"fusion_backend_config\":"
    "{\"kind\":\"__triton_nested_gemm_fusion\",\"block_level_fusion_config\":"
    "{\"num_warps\":\"8\",\"output_tiles\":[{\"sizes\":[\"128\",\"256\"]}]}}}\n}")

# The same, as the H200's XLA (jax 0.11.2) wrote it in bench/gpu.sh's first run: the config's
# fields in name order, "kind" after the nested "block_level_fusion_config" (the reader took
# these 73 GEMMs of the bench step for plain dots until it read the config's own braces).
NESTED_TRITON_H200 = NESTED_TRITON.replace(
    "backend_config={\"fusion_backend_config\":{\"kind\":\"__triton_nested_gemm_fusion\","
    "\"block_level_fusion_config\":{\"num_warps\":\"8\",\"output_tiles\":[{\"sizes\":[\"128\","
    "\"256\"]}]}}}",
    "backend_config={\"device_type\":\"DEVICE_TYPE_INVALID\",\"force_earliest_schedule\":false,"
    "\"fusion_backend_config\":{\"block_level_fusion_config\":{\"group_size\":0,"
    "\"is_tma_allowed\":false,\"is_warp_specialization_allowed\":false,\"num_ctas\":1,"
    "\"num_stages\":3,\"num_tiles_per_pid\":0,\"num_warps\":\"8\",\"output_tiles\":[{\"sizes\":"
    "[\"128\",\"256\"]}],\"waves_per_eu\":0},\"kind\":\"__triton_nested_gemm_fusion\"},"
    "\"operation_queue_id\":\"0\",\"reification_cost\":[]}")

CUDNN_FMHA = module(entry(
    "%q = bf16[8,1024,12,64]{3,2,1,0} parameter(0)",
    "%k = bf16[8,1024,12,64]{3,2,1,0} parameter(1)",
    "%v = bf16[8,1024,12,64]{3,2,1,0} parameter(2)",
    "%fmha = (bf16[8,12,1024,64]{3,1,2,0}, f32[8,12,1024]{2,1,0}, u8[0]{0}) custom-call(%q, "
    "%k, %v), custom_call_target=\"__cudnn$fmhaSoftmax\", backend_config={}",
    "ROOT %gte.1 = bf16[8,12,1024,64]{3,1,2,0} get-tuple-element(%fmha), index=0"))

HOST_CALLBACK = module(entry(
    "%p0 = f32[] parameter(0)",
    "%cb = (f32[]) custom-call(f32[] %p0), custom_call_target=\"xla_ffi_python_gpu_callback\", "
    "api_version=API_VERSION_TYPED_FFI",
    "%s = (f32[], u32[], token[]) send(f32[] %p0, token[] %tok), channel_id=1",
    "ROOT %gte = f32[] get-tuple-element(%cb), index=0"))


def test_cublaslt_bf16_is_a_tensor_core_gemm():
    (g,) = find_gemms(CUBLASLT_BF16)
    assert (g.library, g.target) == ("cublaslt", "__cublas$lt$matmul")
    assert g.operand_dtypes == ("bf16", "bf16") and g.out_dtype == "bf16"
    assert g.operand_elements == (8192 * 768, 768 * 2304) and g.out_elements == 8192 * 2304
    assert g.low_precision
    assert tensor_core_violations([g]) == []


def test_operand_dtypes_resolved_from_names():
    (g,) = find_gemms(CUBLAS_F16_NAMES)
    assert (g.library, g.operand_dtypes, g.out_dtype) == ("cublas", ("f16", "f16"), "f16")
    assert tensor_core_violations([g]) == []


def test_f32_gemm_is_a_violation_unless_a_float32_rule_asks_for_it():
    gemms = find_gemms(CUBLAS_F32)
    assert [g.operand_dtypes for g in gemms] == [("f32", "f32")]
    (why,) = tensor_core_violations(gemms)
    assert "not f16/bf16" in why and "custom-call.2" in why
    # The same GEMM is fine when the traced program holds one float32 matmul of its shape...
    allowed = Counter({gemm_signature((8192 * 768, 768 * 2304), 8192 * 2304): 1})
    assert tensor_core_violations(gemms, allowed) == []
    # ... but one allowance covers one GEMM, and another shape is not covered.
    assert len(tensor_core_violations(gemms + gemms, allowed)) == 1
    other = Counter({gemm_signature((10, 20), 30): 5})
    assert len(tensor_core_violations(gemms, other)) == 1


def test_multiline_instruction_and_mixed_operands():
    comps = parse_hlo(CUBLASLT_MULTILINE)
    assert list(comps) == ["main.9"]
    assert [i.opcode for i in comps["main.9"]][-1] == "custom-call"
    (g,) = find_gemms(CUBLASLT_MULTILINE)
    # rhs was bitcast to f32 in this sample: one f32 operand makes it an f32 GEMM.
    assert g.operand_dtypes == ("bf16", "f32") and not g.low_precision
    assert len(tensor_core_violations([g])) == 1


def test_plain_dot_is_not_a_library_call():
    (g,) = find_gemms(PLAIN_DOT_IN_FUSION)
    assert (g.library, g.target, g.computation) == ("none", "dot", "fused_dot")
    assert g.low_precision  # bf16 operands, and still a violation: no cuBLAS, no Tensor Cores
    (why,) = tensor_core_violations([g])
    assert "not a cuBLAS/cuBLASLt/cuDNN call" in why


def test_triton_gemm_fusion_reads_the_dot_inside():
    (g,) = find_gemms(TRITON_GEMM)
    assert (g.library, g.target, g.name) == ("triton", "__triton_gemm", "gemm_fusion_dot.5")
    assert g.operand_dtypes == ("bf16", "bf16")  # after the convert fused into the GEMM
    assert tensor_core_violations([g]) == []
    # Asked for cuBLAS/cuDNN only, the Triton GEMM is reported.
    assert len(tensor_core_violations([g], libraries=("cublas", "cublaslt", "cudnn"))) == 1


def test_nested_triton_gemm_counts_once_with_its_converted_operands():
    (g,) = find_gemms(NESTED_TRITON)
    assert (g.library, g.target, g.name) == ("triton", "__triton_nested_gemm_fusion",
                                             "gemm_fusion_dot.1")
    assert g.operand_dtypes == ("bf16", "bf16") and g.out_elements == 8192 * 3072
    assert tensor_core_violations([g]) == []
    # The same GEMM fed float32 (no convert in its block fusion) is reported.
    f32 = NESTED_TRITON.replace("ROOT %c = bf16[768,3072]{1,0} convert(%p)",
                                "ROOT %c = f32[768,3072]{1,0} copy(%p)").replace(
        "%block_fusion = bf16[768,3072]", "%block_fusion = f32[768,3072]")
    (g32,) = find_gemms(f32)
    assert g32.operand_dtypes == ("bf16", "f32") and len(tensor_core_violations([g32])) == 1


def test_cudnn_fused_attention():
    (g,) = find_gemms(CUDNN_FMHA)
    assert (g.library, g.target, g.operand_dtypes) == ("cudnn", "__cudnn$fmhaSoftmax",
                                                       ("bf16", "bf16"))
    assert tensor_core_violations([g]) == []


def test_host_traffic():
    assert host_traffic(CUBLASLT_BF16) == []
    found = host_traffic(HOST_CALLBACK)
    assert any("xla_ffi_python_gpu_callback" in f for f in found)
    assert any(f.endswith(": send") for f in found)


def test_summarize():
    gemms = find_gemms(CUBLASLT_BF16) + find_gemms(CUBLAS_F32) + find_gemms(TRITON_GEMM)
    s = summarize(gemms)
    assert s["count"] == 3
    assert s["by_library"] == {"cublaslt": 1, "cublas": 1, "triton": 1}
    assert s["by_operand_dtypes"] == {"bf16xbf16": 2, "f32xf32": 1}


def test_real_cpu_hlo_parses():
    """The reader on a real compiled module (CPU here: XLA:CPU keeps a plain dot, in f32)."""
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    text = f.lower(jnp.ones((64, 32), jnp.bfloat16),
                   jnp.ones((32, 16), jnp.bfloat16)).compile().as_text()
    gemms = find_gemms(text)
    assert len(gemms) == 1 and gemms[0].out_elements == 64 * 16
    assert sorted(gemms[0].operand_elements) == [32 * 16, 64 * 32]
    if jax.default_backend() == "cpu":
        assert gemms[0].library == "none" and tensor_core_violations(gemms)


def test_f32_dot_signatures():
    def f(a, b, c):
        return (a @ b).sum() + (c.astype(jnp.bfloat16) @ c.T.astype(jnp.bfloat16)).sum()

    j = jax.make_jaxpr(f)(jnp.ones((4, 3)), jnp.ones((3, 5)), jnp.ones((2, 6)))
    assert f32_dot_signatures(j) == Counter({gemm_signature((12, 15), 20): 1})


@pytest.mark.parametrize("text", [CUBLASLT_BF16, TRITON_GEMM, PLAIN_DOT_IN_FUSION])
def test_every_computation_closed(text):
    comps = parse_hlo(text)
    assert all(instrs for instrs in comps.values())
    assert sum(1 for c in comps if c.startswith("main")) == 1


def test_triton_gemm_kind_after_a_nested_config():
    assert NESTED_TRITON_H200 != NESTED_TRITON
    (g,) = find_gemms(NESTED_TRITON_H200)
    assert (g.library, g.target) == ("triton", "__triton_nested_gemm_fusion")
    assert g.operand_dtypes == ("bf16", "bf16") and tensor_core_violations([g]) == []
    assert fusion_kind('backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}') \
        == "__cudnn$fusion"
    assert fusion_kind('backend_config={"fusion_backend_config":{"a":{"b":1}}}') is None
    assert fusion_kind("backend_config={}") is None


# ---- kernels: bytes, FLOPs and launches -----------------------------------------------------

def test_a_cublas_gemm_kernel_bytes_and_flops():
    (k,) = kernels(CUBLASLT_BF16)
    assert (k.kind, k.library, k.dtypes, k.times) == ("gemm", "cublaslt", ("bf16", "bf16"), 1)
    assert k.flops == 2 * 8192 * 2304 * 768
    assert k.bytes_read == 2 * (8192 * 768 + 768 * 2304)
    assert k.bytes_written == 2 * 8192 * 2304  # the s8 workspace is scratch, not output


def test_a_triton_gemm_kernel_reads_its_float32_param_and_does_its_dot():
    (k,) = kernels(TRITON_GEMM)
    assert (k.kind, k.library, k.dtypes) == ("gemm", "triton", ("bf16", "bf16"))
    assert k.bytes_read == 4 * 768 * 3072 + 2 * 8192 * 768
    assert k.flops == 2 * 8192 * 3072 * 768


# A scan over 12 layers: the body slices its layer's weights out of the stacked array, writes
# its activation into the stacked output in place, and runs a loop fusion.
LOOP = module(
    "%slice_body (p0: f32[12,256,256], p1: s32[]) -> f32[256,256] {\n"
    "  %p0 = f32[12,256,256]{2,1,0} parameter(0)\n"
    "  %p1 = s32[] parameter(1)\n"
    "  %z = s32[] constant(0)\n"
    "  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), "
    "dynamic_slice_sizes={1,256,256}\n"
    "  ROOT %b = f32[256,256]{1,0} bitcast(%ds)\n}",
    "%dus_body (p0: f32[12,64,256], p1: f32[1,64,256], p2: s32[]) -> f32[12,64,256] {\n"
    "  %p0 = f32[12,64,256]{2,1,0} parameter(0)\n"
    "  %p1 = f32[1,64,256]{2,1,0} parameter(1)\n"
    "  %p2 = s32[] parameter(2)\n"
    "  %z = s32[] constant(0)\n"
    "  ROOT %dus = f32[12,64,256]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)\n}",
    "%body (t: (s32[], f32[12,256,256], f32[12,64,256])) -> (s32[], f32[12,256,256], "
    "f32[12,64,256]) {\n"
    "  %t = (s32[], f32[12,256,256]{2,1,0}, f32[12,64,256]{2,1,0}) parameter(0)\n"
    "  %i = s32[] get-tuple-element(%t), index=0\n"
    "  %w = f32[12,256,256]{2,1,0} get-tuple-element(%t), index=1\n"
    "  %acts = f32[12,64,256]{2,1,0} get-tuple-element(%t), index=2\n"
    "  %layer = f32[256,256]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_body\n"
    "  %new = f32[1,64,256]{2,1,0} parameter(1)\n"
    "  %out = f32[12,64,256]{2,1,0} fusion(%acts, %new, %i), kind=kLoop, calls=%dus_body\n"
    "  ROOT %r = (s32[], f32[12,256,256]{2,1,0}, f32[12,64,256]{2,1,0}) tuple(%i, %w, %out)\n}",
    "%cond (t: (s32[], f32[12,256,256], f32[12,64,256])) -> pred[] {\n"
    "  %t = (s32[], f32[12,256,256]{2,1,0}, f32[12,64,256]{2,1,0}) parameter(0)\n"
    "  ROOT %p = pred[] constant(true)\n}",
    "ENTRY %main (a: (s32[], f32[12,256,256], f32[12,64,256])) -> (s32[], f32[12,256,256], "
    "f32[12,64,256]) {\n"
    "  %a = (s32[], f32[12,256,256]{2,1,0}, f32[12,64,256]{2,1,0}) parameter(0)\n"
    "  ROOT %loop = (s32[], f32[12,256,256]{2,1,0}, f32[12,64,256]{2,1,0}) while(%a), "
    "condition=%cond, body=%body, backend_config={\"known_trip_count\":{\"n\":\"12\"}}\n}")


def test_loop_bodies_run_their_trip_count_and_slices_read_only_their_rows():
    ks = {k.name: k for k in kernels(LOOP)}
    assert set(ks) == {"layer", "out"}
    layer, out = ks["layer"], ks["out"]
    assert layer.times == out.times == 12
    # one layer's [256, 256] float32 weights (and the index), not the whole stack
    assert layer.bytes_read == 4 * 256 * 256 + 4
    assert layer.bytes_written == 4 * 256 * 256
    # written in place: the [1, 64, 256] update read and written, the stack not read
    assert out.bytes_read == 4 * 64 * 256 + 4
    assert out.bytes_written == 4 * 64 * 256


def test_fused_attention_flops_from_its_config():
    cfg = ('backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL",'
           '"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["8","12","1024",'
           '"1024"]}}}')
    text = CUDNN_FMHA.replace("backend_config={}", cfg)
    (k,) = kernels(text)
    assert (k.kind, k.library, k.dtypes) == ("attention", "cudnn", ("bf16", "bf16"))
    assert k.flops == 2 * 2 * (8 * 12 * 1024 * 1024) * 64 // 2  # QK^T and PV, causal half
    bwd = text.replace("fmhaSoftmax\\\"", "fmhaSoftmaxBackward\\\"").replace(
        "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    (kb,) = kernels(bwd)
    assert kb.flops == 5 * k.flops // 2
    assert k.bytes_written == 2 * 8 * 12 * 1024 * 64 + 4 * 8 * 12 * 1024  # out and its stats


def test_a_convolution_counts_its_kernel_window():
    text = module(entry(
        "%x = bf16[8,32,32,64]{3,2,1,0} parameter(0)",
        "%w = bf16[128,3,3,64]{3,2,1,0} parameter(1)",
        "%conv = (bf16[8,32,32,128]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 "
        "pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target=\"__cudnn$convForward\"",
        "ROOT %gte = bf16[8,32,32,128]{3,2,1,0} get-tuple-element(%conv), index=0"))
    (k,) = kernels(text)
    assert (k.kind, k.library) == ("convolution", "cudnn")
    assert k.flops == 2 * (8 * 32 * 32 * 128) * (3 * 3 * 64)


# A100-style fallback (TurnF8DotIntoF16Dot): the quantising fusion converts to float8 and back
# up to f16 inside; the GEMM reads f16. The report must still see float8 data feeding it.
F8_FALLBACK = module(
    "%quant (p: bf16[64,32]) -> (f16[64,32], f32[]) {\n"
    "  %p = bf16[64,32]{1,0} parameter(0)\n"
    "  %q = f8e4m3fn[64,32]{1,0} convert(%p)\n"
    "  %up = f16[64,32]{1,0} convert(%q)\n"
    "  %s = f32[] constant(1)\n"
    "  ROOT %t = (f16[64,32]{1,0}, f32[]) tuple(%up, %s)\n}",
    "ENTRY %main (a: bf16[64,32], b: f16[32,16]) -> f16[64,16] {\n"
    "  %a = bf16[64,32]{1,0} parameter(0)\n"
    "  %b = f16[32,16]{1,0} parameter(1)\n"
    "  %f = (f16[64,32]{1,0}, f32[]) fusion(%a), kind=kLoop, calls=%quant\n"
    "  %g = f16[64,32]{1,0} get-tuple-element(%f), index=0\n"
    "  %gemm = (f16[64,16]{1,0}, s8[1024]{0}) custom-call(%g, %b), "
    "custom_call_target=\"__cublas$lt$matmul\", " + GEMM_CONFIG + "\n"
    "  ROOT %o = f16[64,16]{1,0} get-tuple-element(%gemm), index=0\n}")


def test_a_gemm_fed_float8_data_is_seen_through_its_producer():
    ks = kernels(F8_FALLBACK)
    gemm = next(k for k in ks if k.kind == "gemm")
    assert gemm.dtypes == ("f16", "f16") and gemm.f8_inputs
    assert not next(k for k in kernels(CUBLASLT_BF16) if k.kind == "gemm").f8_inputs
