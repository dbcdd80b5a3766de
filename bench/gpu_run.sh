#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks (python -m bench.NAME), each under its own time limit.
# Usage: bench/gpu_run.sh OUT_DIR [tests|skinny|kernels|decode|lowerings|step|profile|dcp-step|hf-generate|serve-warmup]...   (default: tests kernels decode)
# FlashInfer travels as wheels (README, "On NVIDIA GPUs"): put them in WHEELS (default .whl) to install them here.
set -u
out=${1:?usage: bench/gpu_run.sh OUT_DIR [parts]}; shift
parts=${*:-tests kernels decode}
wheels=${WHEELS:-.whl}
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
for part in $parts; do
  case $part in
    # TESTS_K: a -k expression (spaces kept); TESTS_ARGS: more arguments, split on spaces; TESTS_STOP= (empty) runs on past a failure (default -x).
    tests) timeout "${TESTS_S:-240}" python3 -m pytest tests/gpu -q ${TESTS_STOP--x} -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} ${TESTS_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -25 ;;
    skinny) timeout "${SKINNY_S:-300}" python3 -m bench.skinny_matmul --out "$out/skinny_matmul.json" --table "$out/skinny_configs.json" ${SKINNY_ARGS:-} 2>&1 | tee "$out/skinny.log" | grep -v "^  SkinnyConfig" | tail -40
            export DCP_COMPILE_SKINNY_CONFIGS="$out/skinny_configs.json" ;;  # the later parts use the configs just tuned
    kernels) timeout "${KERNELS_S:-240}" python3 -m bench.kernels --out "$out/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$out/kernels.log" | tail -40 ;;
    decode) timeout "${DECODE_S:-300}" torchrun --nproc-per-node 2 -m bench.decode --out "$out/decode.json" --plot "$out/decode.png" ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" | grep -v "^W1" | tail -60 ;;
    lowerings) timeout "${LOWERINGS_S:-300}" python3 -m bench.lowerings --out "$out/lowerings.json" ${LOWERINGS_ARGS:-} 2>&1 | tee "$out/lowerings.log" | tail -70 ;;
    step) timeout "${STEP_S:-420}" torchrun --nproc-per-node 1 -m bench.step --out "$out/step.json" ${STEP_ARGS:-} 2>&1 | tee "$out/step.log" | grep -v "^W1" | tail -40
          python3 -m bench.report "$out/step.json" --plot "$out/step.png" > "$out/step_table.md" 2>&1 ;;
    profile) timeout "${PROFILE_S:-420}" torchrun --nproc-per-node 1 -m bench.profile_step --out "$out/step_profile.json" ${PROFILE_ARGS:-} 2>&1 | tee "$out/step_profile.log" | grep -v "^W1\|USDT" | tail -80 ;;
    hf-generate) timeout "${HF_S:-420}" python3 -m bench.hf_generate --out "$out/hf_generate.json" ${HF_ARGS:-} 2>&1 | tee "$out/hf_generate.log" | grep -v "^W1" | tail -30 ;;
    serve-warmup) timeout "${SERVE_S:-540}" torchrun --nproc-per-node 1 -m bench.serve_warmup --out "$out/serve_warmup.json" ${SERVE_ARGS:-} 2>&1 | tee "$out/serve_warmup.log" | grep -v "^W1" | tail -30 ;;
    dcp-step) timeout "${DCP_STEP_S:-420}" torchrun --nproc-per-node 2 -m bench.dcp_step --out "$out/dcp_step.json" ${DCP_STEP_ARGS:-} 2>&1 | tee "$out/dcp_step.log" | grep -v "^W1" | tail -60 ;;
  esac
done
python3 -m bench.lib.result "$out"  # no paths of the device machine in what comes back (bench/lib/result.py)
