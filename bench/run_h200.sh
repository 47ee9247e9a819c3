#!/usr/bin/env bash
# bench/run_h200.sh STAGE: the GPU session's measurements, in calls of under 10 minutes each
# (the lent machine keeps ignored build outputs between calls while it stays warm).
#   prep            llama.cpp's CUDA build while the F16 GGUFs are written and the quantized-
#                   kernel GPU tests run
#   prep-test       llama.cpp's CUDA build and the F16 GGUFs (background) while all the GPU
#                   tests run ($OUT/gpu_tests.log)
#   profile         bench/step_profile.py: kernels per decode step, GPU idle share
#   final-a         all the GPU tests, batch-1 decode from random Q4_K_M / Q8_0 weights,
#                   bench/draft_cost.py
#   final-b         bench/assist.py at the 1.5B shape, gpu_bench.py decode (with transformers)
#                   and concurrency
#   pipeline        the kernel GPU tests, step_profile.py with max_model_len 1024 and 32768,
#                   bench/assist.py at the 1.5B shape (random weights, the real tokenizer)
#   build-and-test  llama.cpp's CUDA build (background, 16 cores) while `pytest -m gpu tests/gpu`
#                   runs; test log in $OUT/gpu_tests.log
#   llamacpp        random-weight GGUFs at Qwen2.5 0.5B/1.5B/7B shapes, quantized to Q4_K_M and
#                   Q8_0 by llama-quantize, llama-bench on them at depth 0 and 8192
#                   ($OUT/llamacpp_cuda.json, llamacpp_cuda_d8192.json)
#   final           GPU tests; decode at batch 1 from random weights (no files); qgemm at M = 1
#   gemv-split      bench/gemv_sweep.py over the one-row GEMV's split-K fields, then
#                   bench/step_profile.py A/Bs of the best ones on the 7B and 0.5B decode step
#   rows            all the GPU tests, then bench/qgemm.py at M = 1, 4, 8, 16 (the multi-row int8
#                   GEMV up to gemv_max_m rows) and an A/B of M = 12, 16 on the GEMV
#   verify          bench/tree_verify_cost.py at batch 1/4/16, forced-acceptance decode on
#                   Q4_K_M weights, batch-1 decode from random Q4_K_M / Q8_0 weights
#   decode          luceio on the same files at contexts 512 and 8192, beside llama-bench's
#                   numbers ($OUT/decode_gguf.json)
#   tests-a         the first half of `pytest -m gpu tests/gpu` (a fresh machine's compiles do not
#                   fit the whole suite in one call): warm-up, dense GEMV, engine, families,
#                   kernels, overlap ($OUT/gpu_tests_a.log)
#   tests-b         the rest: quantization, speculation, stages, structured ($OUT/gpu_tests_b.log)
#   check           what changed since the last full pass: the warm-up, speculation, overlap,
#                   engine and kernel GPU tests, bench/triton_compiles.py with an empty Triton
#                   cache ($OUT/triton_compiles.log), forced acceptance (bf16, --quick)
#   tests FILE...   those GPU test files ($OUT/gpu_tests.log)
#   round1/2/3      a whole GPU round in three calls of under 600 s on one warm machine (the
#                   machine goes back 30 s after a call): round1 tests-a, then the decode
#                   (with transformers) and concurrency bench with the real tokenizer;
#                   round2 tests-b, then bench/tree_verify_cost.py; round3 forced acceptance
#                   (bf16, then Q4_K_M), bench/step_profile.py, bench/draft_cost.py. Each
#                   call's steps share one deadline (DEADLINE, 575 s)
#   tails           the quantized GEMV tails (kernels/quant_gemv_tail.py): tests/test_gemv_tail.py
#                   natively, the quantized-engine and speculation GPU tests
#                   ($OUT/gpu_tests_tails.log), then bench/step_profile.py with the tails as the
#                   table has them, off and on again (an A/B; PROFILE_SETS, PROFILE_SHAPES)
#   stages          (nvidia-h200-x2) the two-GPU stage tests ($OUT/gpu_stages_tests.log), then
#                   bench/stages_bench.py --quick ($OUT/stages_bench.json, $OUT/stages_bench.log);
#                   TYPES=bf16,int4 adds the 4-bit rows (about twice the time)
# Needs carry: .llamacpp/src .llamacpp/bench.sh .llamacpp/build.sh .llamacpp/make_gguf.py
#              .llamacpp/prepare.sh (see ../shared/tools/llamacpp/README.md).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/.llamacpp/src/gguf-py:$PWD/.whl/gg${PYTHONPATH:+:$PYTHONPATH}  # .whl/gg: the gguf wheel, unzipped; or wheels installed to a --target on PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# packages the GPU image lacks (xgrammar, starlette, jsonschema, gguf, ...) travel as wheels in
# .whl (carry it): pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl
# (.whl/opt: xgrammar's pydantic and its dependencies, which the GPU image lacks)
if ls .whl/*.whl > /dev/null 2>&1; then
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl $(ls .whl/opt/*.whl 2> /dev/null) || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export GGUF_DIR=$PWD/.llamacpp/gguf
SHAPES=${SHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b}
START=$(date +%s)  # the round stages' steps share one deadline (DEADLINE, 575 s)
left() { echo $(( ${DEADLINE:-575} - ($(date +%s) - START) )); }
case $1 in
  prep)  # the build and the F16 files at once (the machine is released 30 s after a call)
    (bash .llamacpp/build.sh cuda > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log") &
    mkdir -p "$GGUF_DIR"
    for s in $SHAPES; do python3 .llamacpp/make_gguf.py "$s" "$GGUF_DIR/$s-F16.gguf" || exit 1; done
    timeout 200 python -m pytest tests/gpu/test_quant_gpu.py -p no:cacheprovider > "$OUT/gpu_quant_tests.log" 2>&1
    echo "quant gpu tests rc=$?"; tail -2 "$OUT/gpu_quant_tests.log"
    wait; tail -2 "$OUT/llamacpp_build.log" ;;
  prep-test)  # the build and the F16 files in the background while all the GPU tests run
    (bash .llamacpp/build.sh cuda > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log") &
    (mkdir -p "$GGUF_DIR"; for s in $SHAPES; do python3 .llamacpp/make_gguf.py "$s" "$GGUF_DIR/$s-F16.gguf"; done > "$OUT/make_gguf.log" 2>&1) &
    timeout ${TEST_S:-420} python -m pytest -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
    wait; tail -2 "$OUT/llamacpp_build.log"; ls -la "$GGUF_DIR" ;;
  pipeline)  # the kernel GPU tests; kernels per decode step with graphs sized for the context
    # in use and for 32K; the editor-assistant bench at the 1.5B shape (carry .models/qwen2.5-coder-tok)
    timeout ${TEST_S:-150} python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -p no:cacheprovider > "$OUT/gpu_kernel_tests.log" 2>&1
    echo "kernel gpu tests rc=$?"; tail -2 "$OUT/gpu_kernel_tests.log"
    for L in ${MAX_LENS:-1024 32768}; do
      timeout ${PROFILE_S:-130} python bench/step_profile.py --no-eager --max-model-len $L \
        --json-name step_profile_len$L.json --out "$OUT" 2>&1 | grep -v -i warn | cut -c1-300
    done
    timeout ${ASSIST_S:-200} python bench/assist.py --random-shape qwen2.5-1.5b \
      --tokenizer .models/qwen2.5-coder-tok --turns 10 --agent-context 16000 \
      --out "$OUT/assist_1.5b_random.json" 2>&1 | grep -v -i warn | cut -c1-300 | tail -20 ;;
  final-a)  # all the GPU tests; batch-1 decode from random Q4_K_M / Q8_0 weights; draft cost
    timeout ${TEST_S:-300} python -m pytest -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout ${DECODE_S:-150} python bench/decode_gguf.py --random --types Q4_K_M,Q8_0 --contexts 512 \
      --out "$OUT" --json-name decode_quant.json 2>&1 | grep -v -i warn | tail -8
    timeout ${DRAFT_S:-120} python bench/draft_cost.py --out "$OUT" 2>&1 | grep -v -i warn | tail -10 ;;
  final-b)  # the editor-assistant bench; bf16 decode beside transformers; concurrency
    timeout ${ASSIST_S:-150} python bench/assist.py --random-shape qwen2.5-1.5b \
      --tokenizer .models/qwen2.5-coder-tok --turns 10 --agent-context 16000 \
      --out "$OUT/assist_1.5b_random.json" 2>&1 | grep -v -i warn | cut -c1-300 | tail -16
    timeout ${BENCH_S:-300} python bench/gpu_bench.py --quick --sections decode,hf,concurrency \
      --out "$OUT" 2>&1 | grep -v -i warn | cut -c1-400 | tail -16 ;;
  profile)  # kernels per decode step and the GPU's idle share, graphs on and off
    timeout ${PROFILE_S:-200} python bench/step_profile.py --out "$OUT" 2>&1 | grep -v -i warn | tail -6 ;;
  build-and-test)
    (bash .llamacpp/build.sh cuda > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log") &
    timeout 500 python -m pytest -m gpu tests/gpu -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
    wait; tail -2 "$OUT/llamacpp_build.log" ;;
  llamacpp)
    bash .llamacpp/bench.sh cuda "$OUT" $SHAPES -- Q4_K_M Q8_0 || exit 1
    M=(); for s in $SHAPES; do for t in Q4_K_M Q8_0; do M+=(-m "$GGUF_DIR/$s-$t.gguf"); done; done
    .llamacpp/build-cuda/bin/llama-bench "${M[@]}" -p 0 -n 128 -d 8192 -r 2 -ngl 99 -fa 1 \
      -o json > "$OUT/llamacpp_cuda_d8192.json" || echo "llama-bench -d failed"
    cp "$OUT"/llamacpp_cuda*.json "$GGUF_DIR/" ;;  # $OUT is new in every call; GGUF_DIR stays
  decode)
    shapes=$(echo $SHAPES | tr ' ' ',')
    python bench/decode_gguf.py --gguf-dir "$GGUF_DIR" --llamacpp "${LLAMACPP_JSON:-$GGUF_DIR/llamacpp_cuda.json,$GGUF_DIR/llamacpp_cuda_d8192.json}" \
      --shapes "$shapes" --types Q4_K_M,Q8_0 --contexts ${CONTEXTS:-512,8192} --out "$OUT" ;;
  final)  # the GPU tests, decode from random-weight Q4_K_M / Q8_0 at real shapes, one-row kernels
    timeout ${TEST_S:-240} python -m pytest -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout ${DECODE_S:-150} python bench/decode_gguf.py --random --types Q4_K_M,Q8_0 --contexts 512 \
      --out "$OUT" --json-name decode_quant.json 2>&1 | grep -v -i warn | tail -8
    timeout ${QGEMM_S:-110} python bench/qgemm.py --rows 1 --repeats 10 --out "$OUT" 2>&1 | tail -3 ;;
  gemv-split)
    GEMV_SWEEP_GRID=${GEMV_SWEEP_GRID:-"4,1024,1,1;4,512,1,1"} GEMV_SWEEP_QTYPES=${GEMV_SWEEP_QTYPES:-q4_k,q6_k,q8_0} \
      timeout ${SWEEP_S:-300} python bench/gemv_sweep.py --out "$OUT" 2>&1 | grep -v -i warn
    sets=(); for s in ${PROFILE_SETS:-}; do sets+=(--set "$s"); done
    timeout ${PROFILE_S:-250} python bench/step_profile.py --shapes ${PROFILE_SHAPES:-qwen2.5-7b,qwen2.5-0.5b} \
      --no-eager "${sets[@]}" --out "$OUT" 2>&1 | grep -v -i warn | cut -c1-400 ;;
  rows)
    timeout ${TEST_S:-330} python -m pytest -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
    timeout ${QGEMM_S:-150} python bench/qgemm.py --repeats 10 --out "$OUT" 2>&1 | grep -v -i warn | tail -60
    timeout ${QGEMM_AB_S:-80} python bench/qgemm.py --repeats 10 --rows 12,16 --set gemv_max_m=16 \
      --json-name qgemm_gemv16.json --out "$OUT" 2>&1 | grep -v -i warn | tail -40 ;;
  verify)
    timeout ${TREE_S:-240} python bench/tree_verify_cost.py --out "$OUT" 2>&1 | grep -v -i warn | tail -40
    timeout ${FORCED_S:-150} python bench/gpu_bench.py --sections forced --forced-type Q4_K_M --quick \
      --json-name gpu_bench_forced_q4km.json --out "$OUT" 2>&1 | grep -v -i warn | tail -20
    timeout ${DECODE_S:-150} python bench/decode_gguf.py --random --types Q4_K_M,Q8_0 --contexts 512 \
      --out "$OUT" --json-name decode_quant.json 2>&1 | grep -v -i warn | tail -8 ;;
  tests-a)
    timeout ${TEST_S:-530} python -m pytest -m gpu tests/gpu/test_warmup_gpu.py tests/gpu/test_dense_gemv_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_families_gpu.py tests/gpu/test_kernels_gpu.py \
      tests/gpu/test_overlap_gpu.py -p no:cacheprovider -rs > "$OUT/gpu_tests_a.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_a.log" ;;
  tests-b)
    timeout ${TEST_S:-530} python -m pytest -m gpu tests/gpu/test_quant_gpu.py tests/gpu/test_quant_engine_gpu.py \
      tests/gpu/test_quant_format_gpu.py tests/gpu/test_spec_gpu.py tests/gpu/test_stages_gpu.py \
      tests/gpu/test_structured_gpu.py -p no:cacheprovider -rs > "$OUT/gpu_tests_b.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_b.log" ;;
  check)
    timeout ${TEST_S:-250} python -m pytest -m gpu tests/gpu/test_warmup_gpu.py tests/gpu/test_spec_gpu.py \
      tests/gpu/test_overlap_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_kernels_gpu.py \
      -p no:cacheprovider -rs > "$OUT/gpu_tests_check.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_check.log"
    TRITON_CACHE_DIR=$(mktemp -d) timeout ${COMPILES_S:-110} python bench/triton_compiles.py > "$OUT/triton_compiles.log" 2>&1
    echo "compiles rc=$?"; grep -E "COMPILE-MISS|SLOW STEP|PHASE" "$OUT/triton_compiles.log" | grep -A1000 "PHASE n=1 new=4" | cut -c1-160
    timeout ${FORCED_S:-190} python bench/gpu_bench.py --sections forced --quick --out "$OUT" \
      --json-name gpu_bench_forced_check.json 2>&1 | grep "^{" | cut -c1-420 ;;
  tests)  # the GPU test files named after the stage, in order ($OUT/gpu_tests.log)
    shift
    timeout ${TEST_S:-530} python -m pytest -m gpu "$@" -p no:cacheprovider -rs > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log" ;;
  round1)
    TEST_S=${TA:-340} bash "$0" tests-a
    timeout $(( $(left) - 5 )) python bench/gpu_bench.py --quick --sections decode,hf,concurrency \
      --tokenizer .models/qwen2.5-coder-tok --out "$OUT" 2>&1 | grep -v -i warn | cut -c1-300 | tail -20 ;;
  round2)
    TEST_S=${TB:-430} bash "$0" tests-b
    timeout $(( $(left) - 5 )) python bench/tree_verify_cost.py --out "$OUT" 2>&1 | grep -v -i warn | tail -24 ;;
  round3)
    timeout 120 python bench/gpu_bench.py --sections forced --quick --out "$OUT" \
      --json-name gpu_bench_forced.json 2>&1 | grep "^{" | cut -c1-300
    timeout 100 python bench/gpu_bench.py --sections forced --forced-type Q4_K_M --quick --out "$OUT" \
      --json-name gpu_bench_forced_q4km.json 2>&1 | grep "^{" | cut -c1-300
    timeout 100 python bench/step_profile.py --no-eager --out "$OUT" 2>&1 | grep -v -i warn | tail -4 | cut -c1-300
    timeout $(( $(left) - 5 )) python bench/draft_cost.py --repeats 10 --ks 4,6,8 --out "$OUT" 2>&1 \
      | grep -v -i warn | cut -c1-260 | tail -8 ;;
  tails)
    timeout ${TEST_S:-330} bash -c "python -m pytest tests/test_gemv_tail.py -p no:cacheprovider -q; \
      python -m pytest -m gpu tests/gpu/test_quant_engine_gpu.py tests/gpu/test_spec_gpu.py \
      -p no:cacheprovider -rs" > "$OUT/gpu_tests_tails.log" 2>&1
    echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests_tails.log" | tail -4
    sets=(); for s in ${PROFILE_SETS:-gemv_tails=False gemv_tails=True}; do sets+=(--set "$s"); done
    timeout $(( $(left) - 5 )) python bench/step_profile.py --no-eager \
      --shapes ${PROFILE_SHAPES:-qwen2.5-0.5b,qwen2.5-1.5b} "${sets[@]}" --out "$OUT" \
      --json-name step_profile_tails.json 2>&1 | grep -v -i warn | cut -c1-330 ;;
  stages)  # pipeline stages on two GPUs: NCCL and host-staged vs one GPU, then the bench
    timeout ${TEST_S:-150} python -m pytest -m gpu tests/gpu/test_stages_gpu.py -p no:cacheprovider > "$OUT/gpu_stages_tests.log" 2>&1
    echo "stage gpu tests rc=$?"; tail -3 "$OUT/gpu_stages_tests.log"
    timeout ${STAGES_S:-430} python bench/stages_bench.py --quick --types ${TYPES:-bf16} \
      --budget-s ${STAGES_BUDGET_S:-400} --out "$OUT" > "$OUT/stages_bench.log" 2>&1
    echo "stages bench rc=$?"; grep -v -i warn "$OUT/stages_bench.log" | tail -14 | cut -c1-300 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
