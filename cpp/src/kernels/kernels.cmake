# CPU kernels of vpage_core. The attention task kernels (attention_*impl.h), the quantized
# matmul task (quant_matmul_impl.h) and the dense matmul task (dense_matmul_impl.h) are
# compiled once per instruction set, each build in its own namespace with its own -m flags;
# cpu_isa.cpp picks one at run time with __builtin_cpu_supports (quant_matmul.cpp and
# dense_matmul.cpp follow its choice). Everything else uses baseline flags. Levels: generic, avx2, avx2vnni, avx512, avx512vnni (the VNNI levels differ
# from the level below them only in the quantized matmul; avx2vnni needs a compiler that knows
# -mavxvnni, GCC 11 or Clang 12).
set(_vpage_kernels_dir ${CMAKE_CURRENT_LIST_DIR})
target_sources(vpage_core PRIVATE
  ${_vpage_kernels_dir}/thread_pool.cpp
  ${_vpage_kernels_dir}/cpu_isa.cpp
  ${_vpage_kernels_dir}/paged_attention.cpp
  ${_vpage_kernels_dir}/packed_attention.cpp
  ${_vpage_kernels_dir}/cache_ops.cpp
  ${_vpage_kernels_dir}/rotary.cpp
  ${_vpage_kernels_dir}/layer_ops.cpp
  ${_vpage_kernels_dir}/sampler_ops.cpp
  ${_vpage_kernels_dir}/token_bitmask.cpp
  ${_vpage_kernels_dir}/attention_generic.cpp
  ${_vpage_kernels_dir}/float_rows.cpp
  ${_vpage_kernels_dir}/quant_matmul.cpp
  ${_vpage_kernels_dir}/dense_matmul.cpp
  ${_vpage_kernels_dir}/lora.cpp
  ${_vpage_kernels_dir}/fused_moe.cpp
  ${_vpage_kernels_dir}/decoder_forward.cpp
  ${_vpage_kernels_dir}/quant_generic.cpp
  ${_vpage_kernels_dir}/dense_generic.cpp)

# Rotary, layer and sampler ops: no FMA contraction, so float32 results equal torch's unfused
# multiply and add. -fno-trapping-math (results unchanged: it only drops the promise to raise
# floating-point exceptions where the source does) lets GCC vectorise exp_clamped's float-to-int
# conversion for AVX2; without it only the AVX-512 clones of the exp loops were vectorised.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set_source_files_properties(${_vpage_kernels_dir}/rotary.cpp
    TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "-ffp-contract=off")
  set_source_files_properties(${_vpage_kernels_dir}/layer_ops.cpp ${_vpage_kernels_dir}/sampler_ops.cpp
    TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "-ffp-contract=off;-fno-trapping-math")
endif()

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$"
   AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_sources(vpage_core PRIVATE
    ${_vpage_kernels_dir}/attention_avx2.cpp
    ${_vpage_kernels_dir}/attention_avx512.cpp
    ${_vpage_kernels_dir}/quant_avx2.cpp
    ${_vpage_kernels_dir}/quant_avx512.cpp
    ${_vpage_kernels_dir}/quant_avx512vnni.cpp
    ${_vpage_kernels_dir}/dense_avx2.cpp
    ${_vpage_kernels_dir}/dense_avx512.cpp)
  set_source_files_properties(${_vpage_kernels_dir}/attention_avx2.cpp ${_vpage_kernels_dir}/quant_avx2.cpp
    ${_vpage_kernels_dir}/dense_avx2.cpp
    TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
  # -Wno-(maybe-)uninitialized: GCC 12 false positives inside its own AVX-512 headers.
  set(_vpage_avx512_flags "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mavx2;-mfma;-mf16c;-Wno-maybe-uninitialized;-Wno-uninitialized")
  set_source_files_properties(${_vpage_kernels_dir}/attention_avx512.cpp ${_vpage_kernels_dir}/quant_avx512.cpp
    ${_vpage_kernels_dir}/dense_avx512.cpp
    TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "${_vpage_avx512_flags}")
  # The avx512vnni level: AVX-512 attention (VNNI changes nothing there), VNNI quantized matmul.
  set_source_files_properties(${_vpage_kernels_dir}/quant_avx512vnni.cpp
    TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "${_vpage_avx512_flags};-mavx512vnni")
  set(_vpage_x86_definitions VPAGE_X86_KERNELS=1)
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-mavxvnni VPAGE_COMPILER_HAS_AVXVNNI)
  if(VPAGE_COMPILER_HAS_AVXVNNI)
    target_sources(vpage_core PRIVATE ${_vpage_kernels_dir}/quant_avx2vnni.cpp)
    set_source_files_properties(${_vpage_kernels_dir}/quant_avx2vnni.cpp
      TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-mavxvnni")
    list(APPEND _vpage_x86_definitions VPAGE_AVX2VNNI_KERNELS=1)
  endif()
  # bfloat16 x bfloat16 dense matmuls and decode attention's bfloat16 QK with bf16 dot
  # products, chosen at run time on CPUs with
  # AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids); needs a compiler that knows -mavx512bf16.
  check_cxx_compiler_flag(-mavx512bf16 VPAGE_COMPILER_HAS_AVX512BF16)
  if(VPAGE_COMPILER_HAS_AVX512BF16)
    target_sources(vpage_core PRIVATE ${_vpage_kernels_dir}/dense_avx512bf16.cpp
      ${_vpage_kernels_dir}/attention_avx512bf16.cpp)
    set_source_files_properties(${_vpage_kernels_dir}/dense_avx512bf16.cpp
      ${_vpage_kernels_dir}/attention_avx512bf16.cpp TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_OPTIONS "${_vpage_avx512_flags};-mavx512bf16")
    list(APPEND _vpage_x86_definitions VPAGE_AVX512BF16_KERNELS=1)
  endif()
  set_source_files_properties(${_vpage_kernels_dir}/cpu_isa.cpp ${_vpage_kernels_dir}/quant_matmul.cpp
    ${_vpage_kernels_dir}/dense_matmul.cpp ${_vpage_kernels_dir}/paged_attention.cpp
    ${_vpage_kernels_dir}/packed_attention.cpp TARGET_DIRECTORY vpage_core PROPERTIES COMPILE_DEFINITIONS "${_vpage_x86_definitions}")
endif()
