#!/usr/bin/env bash
# The GPU tier in one call on the H200 (through the device tool): tests + benchmarks + tuning.
#   bash scripts/gpu_check.sh [STAGE ...]     stages: tests, tests:<paths>, bench:<suite>[,<suite>...],
#                                             layer:<part>[,<part>...] (the layer sweep, a part = an --only filter),
#                                             setup (the preamble alone), tune:<op>[,<op>...] (hpcops tune: decode, moe, moe-shapes, rope,
#                                             prefill, prefill-gluon),
#                                             ep2 (two-GPU expert parallelism, scripts/moe_ep2.py),
#                                             profile:decode (ncu), profile:decode-kernels (per-kernel µs of a step),
#                                             floor:decode (the h8/1 rows against their KV read time, decode_read_floor.py),
#                                             profile:prefill (ncu on the bf16 and fp8 Gluon prefill kernels),
#                                             profile:moe (per-kernel µs, scripts/profile_moe.py;
#                                             PROFILE_ARGS adds options), smoke (the smallest complete run of every GPU
#                                             tool: hpcops tune <op> --smoke for every op, profile_decode.py)
# Several GPUs in one device call: scripts/gpu_parallel.py (one queue of stages per GPU, one archive back).
# Default: tests bench:decode,moe,rope,prefill. Results go to $OUT (or ./out): logs, and one
# results.tar.gz (kept across invocations) holding bench/results/*.{json,md,png} to unpack into bench/results/ (the `tests`
# stage writes results/gpu_tests.txt; `smoke` writes results/smoke/). Set GIT_REV to the commit of the
# working tree (the device copy has no .git): gpu_tests.txt names it as the tested tree.
# FlashInfer (a peer) is installed from .whl/ when present (carry it: ../shared/tools/peer_wheels.sh .whl).
# The bench's SM MHz column (hpcops.bench.clock, NVML) needs nvidia-ml-py there too: python3 -m pip download --no-deps
# --only-binary=:all: -d .whl nvidia-ml-py (a pure-Python wheel).
# The decode grid (issue 10): BENCH_ARGS="--grid --quick" bash scripts/gpu_check.sh bench:decode, carrying .whl
# and .peers (vLLM's unified attention, its peer where FlashInfer cannot run); the full grid in parts: see
# hpcops/bench/suites/decode_grid.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" "$OUT/results"
# a second invocation in the same device call adds to the first one's archive (it used to replace it)
[ -f "$OUT/results.tar.gz" ] && tar -xzf "$OUT/results.tar.gz" -C "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  # once a machine (jobs running side by side, scripts/gpu_parallel.py, find it done)
  if [ -f /tmp/site/.hpcops-wheels ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.hpcops-wheels; }; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
# Nsight Compute on one launch (the second) of the kernels matching regex $1; the rest are ncu's options and the command
ncu_one() {
  local k=$1; shift
  timeout 240 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 1 --launch-count 1 "$@"
}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests bench:decode,moe,rope,prefill)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
status=0
for st in "${stages[@]}"; do
  case "$st" in
    tests)
      # Every test natively on the GPU: the CPU tier's cases plus the @pytest.mark.gpu ones. One
      # process per file, in parallel: Triton compilation is CPU-bound and the machine has 16 cores.
      # Each file writes a JUnit report; gpu_tests_report.py sums them into results/gpu_tests.txt. Verbose logs:
      # a test that hangs (killed by TEST_TIMEOUT, no JUnit report) is the last one named in its log.
      pids=()
      # The sm_90 build checks (*_compile.py: triton.compile and ptxas, nothing on the GPU) and the PTX fingerprint
      # check (test_measured_kernels.py) compute on the CPU alone, with the same Triton 3.6.0 as the CPU tier, where
      # CI runs them; here they took a third of the tier's test-seconds (session 58: 1916 of 5970) beside the GPU
      # files. So they are left to CI; GPU_TIER_BUILDS=1 runs them here too.
      files=() builds=()
      for f in tests/test_*.py; do
        case "$(basename "$f" .py)" in
          *_compile|test_measured_kernels) [ "${GPU_TIER_BUILDS:-0}" = 1 ] && files+=("$f") || builds+=("$f");;
          *) files+=("$f");;
        esac
      done
      mkdir -p "$OUT/results/tests"
      for f in "${files[@]}"; do
        n=$(basename "$f" .py)
        # the sm_90 build checks (*_compile.py: ptxas in subprocesses, nothing on the GPU) on 4 xdist workers: alone
        # among the 40 files on 16 cores test_prefill_compile.py's 35 builds ran past 420 s (session 30)
        # the five longest GPU files (275-327 s each at 1c6de6a, session 32, while the other 35 were done by ~210 s)
        # on 2 workers each, so that their last minutes use the cores the finished files left
        xd=(); case "$n" in *_compile) xd=(-n 4);;
          test_decode|test_prefill|test_decode_kernels|test_moe|test_decode_paths) xd=(-n 2);; esac
        # 560 s a file: at a5dbcb5 (session 31) test_decode.py, test_decode_kernels.py and test_prefill.py, the
        # longest GPU files, ran past 420 s at 88-93 % of their tests beside the compile files' workers
        timeout ${TEST_TIMEOUT:-560} python3 -m pytest -v -p no:cacheprovider -rs "${xd[@]}" "$f" \
          --junitxml="$OUT/results/tests/junit_$n.xml" > "$OUT/results/tests/$n.log" 2>&1 &
        pids+=($!)
      done
      # pytest's 5 = nothing collected (a module skipped whole, e.g. test_vllm.py without vLLM): not a failure
      for p in "${pids[@]}"; do wait "$p"; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1; done
      versions=$(python3 -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__},', \
        torch.cuda.get_device_name())" 2>&1 | tail -1)
      python3 scripts/gpu_tests_report.py "$OUT/results/tests" --rev "${GIT_REV:-unknown}" --versions "$versions" \
        --files "$(IFS=,; echo "${files[*]}")" > "$OUT/results/gpu_tests.txt" || status=1
      [ ${#builds[@]} -eq 0 ] || echo "left to the CPU tier (CPU-only builds; GPU_TIER_BUILDS=1 runs them here): ${builds[*]}" \
        >> "$OUT/results/gpu_tests.txt"
      head -30 "$OUT/results/gpu_tests.txt"
      grep -h -E "^(FAILED|ERROR)" "$OUT"/results/tests/test_*.log | head -40 ;;
    smoke)
      # The smallest complete run of every GPU tool: `hpcops tune <op> --smoke` for every op, profile_decode.py.
      sm="$OUT/results/smoke"
      mkdir -p "$sm"
      for s in decode decode-grid moe moe-shapes rope prefill prefill-gluon; do
        echo "== hpcops tune $s --smoke" | tee -a "$sm/smoke.log"
        timeout 300 python3 -m hpcops tune "$s" --smoke --out "$sm" --no-progress >> "$sm/smoke.log" 2>&1 \
          && echo "tune_$s: ok" | tee -a "$sm/smoke.log" || { echo "tune_$s: FAILED" | tee -a "$sm/smoke.log"; status=1; }
      done
      echo "== profile_decode.py under ncu" | tee -a "$sm/smoke.log"
      ncu_one decode_persistent \
        --section LaunchStats --section SpeedOfLight python3 scripts/profile_decode.py --spec 8x4K > "$sm/ncu_smoke.txt" 2>&1 \
        && grep -q "decode_persistent" "$sm/ncu_smoke.txt" && echo "profile_decode: ok" | tee -a "$sm/smoke.log" \
        || { echo "profile_decode: FAILED" | tee -a "$sm/smoke.log"; tail -20 "$sm/ncu_smoke.txt"; status=1; }
      grep -h -E "^(=|tune_|profile_|\| )" "$sm/smoke.log" | tail -30 ;;
    tests:*)
      # TESTS_XDIST=N: on N xdist workers (a single-process `tests:tests/test_moe.py -k fuse`, 145 GPU cases, took
      # 236 s in session 33, most of it compiling on one of the 16 cores). The workers share one GPU's memory: on an
      # H100's 80 GB, test_moe.py lost 28 cases to torch.OutOfMemoryError on 14 workers and 2 on 6 (session 55)
      # shell quoting kept: "tests:tests/test_decode.py -k 'tail or combine'" (unquoted, -k got three words)
      eval "targs=(${st#tests:})"
      timeout 420 python3 -m pytest -q -p no:cacheprovider ${TESTS_XDIST:+-n $TESTS_XDIST} "${targs[@]}" 2>&1 \
        | tee -a "$OUT/tests.log" | tail -25 || status=1 ;;
    bench:*)
      IFS=, read -ra suites <<< "${st#bench:}"
      # BENCH_TIMEOUT (seconds a suite, default none): a hanging kernel ends its suite, not the whole device call
      # (the reports are rewritten after every case, so what was measured stays)
      eval "bargs=(${BENCH_ARGS:-})"  # shell quoting kept: --only 'd256 p64 bf16,d256 p32 bf16'
      for s in "${suites[@]}"; do
        timeout "${BENCH_TIMEOUT:-0}" python3 -m hpcops bench "$s" --out "$OUT/results" --no-progress "${bargs[@]}" 2>&1 \
          | tee -a "$OUT/bench.log" | grep -v '^\[' | tail -60 || status=1
        # the issue targets of this run beside the report, where the suite has a script for them
        # (scripts/decode_targets.py: issue 10 and the copy-floor bound; scripts/prefill_targets.py: issue 12)
        if [ -f "scripts/${s}_targets.py" ] && [ -f "$OUT/results/$s.json" ] && [[ " ${bargs[*]:-} " != *" --grid "* ]]
        then
          python3 "scripts/${s}_targets.py" "$OUT/results/$s.json" > "$OUT/results/${s}_targets.md" 2>&1 \
            && cat "$OUT/results/${s}_targets.md"
        fi
      done ;;
    layer:*)
      # the layer sweep in parts (each under the device's per-command limit): one `--only <part>` run a part, into
      # results/layer_<part>/; join them with python3 -m hpcops.bench.suites._layer_report OUT DIR...
      IFS=, read -ra parts <<< "${st#layer:}"
      for p in "${parts[@]}"; do
        timeout "${BENCH_TIMEOUT:-0}" python3 -m hpcops bench layer --only "$p" --out "$OUT/results/layer_$p" \
          --no-progress 2>&1 | tee -a "$OUT/bench.log" | grep -v '^\[' | tail -30 || status=1
      done ;;
    ep2)
      # expert parallelism over NCCL on two GPUs (the nvidia-h200-x2 machine): results/moe_ep2.{json,md}
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GIT_REV=${GIT_REV:-unknown} \
        timeout 540 python3 scripts/moe_ep2.py --out "$OUT/results" 2>&1 | tee -a "$OUT/ep2.log" | tail -40 \
        || status=1 ;;
    profile:decode)
      # Nsight Compute on the decode attention kernel (the persistent `tl` one, or with --schedule static the
      # static one): stall reasons, memory throughput, occupancy. PROFILE_RUNS: ';'-separated profile_decode.py
      # argument lists (default: 64x4K over fp8 and over bf16 KV)
      IFS=';' read -ra pruns <<< "${PROFILE_RUNS:---spec 64x4K --kv fp8;--spec 64x4K --kv bf16}"
      for args in "${pruns[@]}"; do
        echo "=== profile_decode.py $args" | tee -a "$OUT/results/ncu_decode.txt"
        ncu_one 'decode_persistent|decode_static_kernel' \
          --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section SchedulerStats --section WarpStateStats \
          python3 scripts/profile_decode.py $args 2>&1 | tee -a "$OUT/results/ncu_decode.txt" | tail -60
      done ;;
    profile:prefill)
      # Nsight Compute on the prefill kernels (h64/8 q8k unless PROFILE_SHAPE says otherwise): the bf16 default (the
      # warp-specialized Gluon kernel) and the fp8 default (the Gluon kernel in fp8), one launch each: stall reasons,
      # issue, pipes, and shared memory's instructions, wavefronts and bank conflicts (loads, stores) beside the tensor
      # pipe; SourceCounters names the instructions with the most stall samples and excess shared wavefronts
      smem=l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
      smem=$smem,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
      smem=$smem,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
      smem=$smem,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum
      smem=$smem,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
      # every stall reason (cycles a warp waits, per issued instruction) and every pipe's utilization (MUFU: xu)
      smem=$smem,'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
      smem=$smem,'regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$'
      # PROFILE_SHAPE: the case (profile_prefill.py's options, default "--spec q8k --heads 64/8"; e.g. "--spec q8k
      # --heads 8/1", where issue 12's fp8 / bf16 ratio is the kernels' compute alone);
      # PROFILE_QS: which q dtypes (default "bf16 fp8"); PROFILE_CONFIGS: fp8 variants beside the default, each an
      # HPCOPS_PREFILL_CONFIG string, ';'-separated (e.g. "gluon=1,gluon_p_dbuf=1"), each profiled (and with NCU_SASS
      # its SASS written) under its own heading
      runs=()
      for q in ${PROFILE_QS:-bf16 fp8}; do runs+=("$q|"); done
      IFS=';' read -ra pcfgs <<< "${PROFILE_CONFIGS:-}"
      for c in "${pcfgs[@]}"; do [ -n "$c" ] && runs+=("fp8|$c"); done
      for r in "${runs[@]}"; do
        q=${r%%|*} c=${r#*|}
        echo "=== profile_prefill --q $q ${c:+HPCOPS_PREFILL_CONFIG=$c}" | tee -a "$OUT/results/ncu_prefill.txt"
        HPCOPS_PREFILL_CONFIG=$c ncu_one prefill_gluon \
          --section LaunchStats --section Occupancy --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --metrics "$smem" \
          --section SourceCounters python3 scripts/profile_prefill.py --q "$q" ${PROFILE_SHAPE:-} 2>&1 \
          | tee -a "$OUT/results/ncu_prefill.txt" | tail -60
        # NCU_SASS=1: an fp8 kernel's SASS with each instruction's executed count and stall samples (the source
        # page as CSV): which instructions the warps wait at
        if [ "${NCU_SASS:-0}" = 1 ] && [ "$q" = fp8 ]; then
          sass="$OUT/results/ncu_prefill_sass${c:+_$(echo "$c" | tr -c 'a-zA-Z0-9_\n' _)}.csv"
          HPCOPS_PREFILL_CONFIG=$c ncu_one prefill_gluon \
            --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
            python3 scripts/profile_prefill.py --q fp8 ${PROFILE_SHAPE:-} > "$sass" 2>&1
          # the stall samples by opcode and reason in each consumer's softmax loop (scripts/ncu_sass_summary.py)
          python3 scripts/ncu_sass_summary.py "$sass" > "${sass%.csv}_summary.txt" 2>&1 && head -12 "${sass%.csv}_summary.txt"
        fi
      done ;;
    profile:decode-kernels)
      # per-kernel device time of a decode step (plan, attention, combine) per DecodeConfig variant:
      # results/profile_decode_kernels.txt (PROFILE_ARGS: --only, --variants; scripts/profile_decode_kernels.py)
      eval "pargs=(${PROFILE_ARGS:-})"  # shell quoting kept: --only "64x4K h8/1 fp8"
      timeout 420 python3 scripts/profile_decode_kernels.py "${pargs[@]}" 2>&1 \
        | tee -a "$OUT/results/profile_decode_kernels.txt" | tail -80 || status=1 ;;
    profile:moe)
      # per-kernel device time of fused_moe (and vLLM's GEMMs) on the moe suite's scenarios: results/profile_moe.txt
      eval "pargs=(${PROFILE_ARGS:-})"  # shell quoting kept: --configs 'reduce_block_h=256;prequant_x=0'
      timeout 420 python3 scripts/profile_moe.py "${pargs[@]}" 2>&1 | tee -a "$OUT/results/profile_moe.txt" | tail -80 \
        || status=1 ;;
    floor:decode)
      # issue 10's h8/1 rows against the time of reading their KV alone (scripts/decode_read_floor.py): the bf16 rows
      # (target 1.3), then the fp8 ones (1.5); results/decode_read_floor{,_fp8}.{md,json}. FLOOR_ARGS adds options.
      eval "fargs=(${FLOOR_ARGS:-})"
      timeout 200 python3 scripts/decode_read_floor.py --out "$OUT/results" "${fargs[@]}" 2>&1 | tail -20 || status=1
      mkdir -p "$OUT/floor_fp8"
      timeout 200 python3 scripts/decode_read_floor.py --only 'h8/1 fp8' --target 1.5 --out "$OUT/floor_fp8" \
        "${fargs[@]}" 2>&1 | tail -20 || status=1
      for e in md json; do
        [ -f "$OUT/floor_fp8/decode_read_floor.$e" ] && mv "$OUT/floor_fp8/decode_read_floor.$e" \
          "$OUT/results/decode_read_floor_fp8.$e"
      done ;;
    tune:*)
      # `hpcops tune <op>` for each op: <op>_tune.{md,json} (+ moe_tuned.json) in results/; TUNE_ARGS adds options
      IFS=, read -ra ops <<< "${st#tune:}"
      eval "targs=(${TUNE_ARGS:-})"  # shell quoting kept: --only "h8/1 fp8"
      for o in "${ops[@]}"; do
        python3 -m hpcops tune "$o" --out "$OUT/results" --no-progress "${targs[@]}" 2>&1 \
          | tee -a "$OUT/tune.log" | grep -v '^\[' | tail -60 || status=1
      done ;;
    setup) ;;  # the preamble only (FlashInfer wheels into /tmp/site, editable install): gpu_parallel.py runs it once
    *) echo "unknown stage $st"; status=2 ;;
  esac
  tar -czf "$OUT/results.tar.gz" -C "$OUT" results  # after every stage: a later timeout loses nothing
done
rm -rf "$OUT/results"
exit $status
