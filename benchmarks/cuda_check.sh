#!/usr/bin/env bash
# The CUDA path in one run on an NVIDIA GPU (engine tests on cuda, then throughput-A on a random-weight model of the default model's shape): OUT=/tmp/cuda-check bash benchmarks/cuda_check.sh
#   1. the engine-level tests with the engine on cuda (transformers, the oracle,
#      stays on the CPU): greedy tokens and logprobs, sampling, errors, aborts;
#   2. throughput-A (static vs continuous, CAP 128 and 512, max_num_seqs 128, bf16)
#      on random weights of SmolLM2-135M's shape: with ignore_eos the speed
#      depends on the shapes alone. The real tokenizer is used where TOKENIZER_DIR
#      holds it (saved from the GGUF: Tokenizer.load(...).hf.save_pretrained).
# DEVICE=cpu runs the same steps here (a dry run of the script itself).
# Wheels of packages the GPU machine lacks (gguf) may lie in .whl/.
set -u
OUT=${OUT:-/tmp/cuda-check}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
CAPS=${CAPS:-128,512}
TOKENIZER_DIR=${TOKENIZER_DIR:-.gpu/smollm2-tokenizer}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi -L 2>/dev/null
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"

echo "== 1. engine tests, engine on $DEVICE"
TOKENMILL_TEST_DEVICE=$DEVICE timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider \
    tests/test_correctness.py tests/test_sampling_engine.py tests/test_engine.py \
    >"$OUT/tests.log" 2>&1
echo "pytest exit $?"; tail -n 25 "$OUT/tests.log"

echo "== 2. throughput-A on $DEVICE, default model's shape, random weights"
$PY - <<'EOF'
import torch, transformers
config = transformers.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained("/tmp/smollm2-shape", safe_serialization=True)
print("saved /tmp/smollm2-shape")
EOF
cp "$TOKENIZER_DIR"/* /tmp/smollm2-shape/
timeout "${BENCH_TIMEOUT:-300}" $PY -m tokenmill.bench.throughput --model /tmp/smollm2-shape \
    --device "$DEVICE" --caps "$CAPS" --policies static,continuous --max-num-seqs 128 \
    --output-dir "$OUT" 2>"$OUT/bench.err"
echo "bench exit $?"; grep -v "Processed prompts" "$OUT/bench.err" | tail -n 8
