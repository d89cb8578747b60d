#!/usr/bin/env bash
# The engine against llama.cpp at every thread count, on the files the comparison names: a dense
# and a MoE model, each in Q4_K_M and Q8_0, all over 2 GB (bench/results/engine.md, "Every core").
#
#   bash bench/engine_cores.sh [OUT_DIR] [THREADS]      # THREADS default: 1,2,4,8,16 (capped at the cores)
#
# llama.cpp: $LLAMA_BENCH (a llama-bench binary), else built here from $LLAMA_CPP_SRC (a llama.cpp
# source tree), else from the llama-cpp-python sdist pip downloads (its vendor/llama.cpp), with
# -DGGML_NATIVE=ON: the CPU's own instruction set (LLAMA_NO_AMX=1 also passes -mno-amx-*: on a VM
# that reports AMX without enabling it, the native build crashes at its first product). Each thread count runs colibri with the Python
# pool and with the spinning workers (COLIBRI_SWARM_SPIN=0/1). The files are written once into
# $BENCH_FILES (default OUT_DIR/files); a machine without the default model takes a tokenizer
# GGUF from $BENCH_TOKENIZER_GGUF (python3 bench/engine.py --make-tokenizer TOK.gguf).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/engine_cores}"
cores="$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')"
threads="${2:-$(python3 -c "print(','.join(str(n) for n in (1, 2, 4, 8, 16) if n <= $cores))")}"
files="${BENCH_FILES:-$out/files}"
mkdir -p "$out" "$files"

if [ -z "${LLAMA_BENCH:-}" ]; then
    src="${LLAMA_CPP_SRC:-}"
    if [ -z "$src" ]; then
        python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$out/sdist"
        tar -xzf "$out"/sdist/llama_cpp_python-*.tar.gz -C "$out/sdist"
        src="$(ls -d "$out"/sdist/llama_cpp_python-*/vendor/llama.cpp)"
    fi
    flags=()
    [ "${LLAMA_NO_AMX:-0}" = 1 ] && flags=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                                           "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    cmake -S "$src" -B "$out/llama-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "${flags[@]}" >"$out/cmake.log"
    cmake --build "$out/llama-build" --target llama-bench -j "$cores" >"$out/build.log"
    LLAMA_BENCH="$out/llama-build/bin/llama-bench"
fi
"$LLAMA_BENCH" --version 2>&1 | tee "$out/llama-bench-version.txt"

tok=()
[ -n "${BENCH_TOKENIZER_GGUF:-}" ] && tok=(--tokenizer-from "$BENCH_TOKENIZER_GGUF")
for kind in moe dense; do
    for type in Q4_K_M Q8_0; do
        f="$files/${kind}_${type}.gguf"
        [ -f "$f" ] || python3 bench/engine.py "${tok[@]}" "--make-${kind}-2g" "$f" "$type"
        # one short run first: the kernels are compiled (once per machine) outside the timed runs
        python3 bench/engine.py --model "$f" --threads 1 --engines colibri --prompt-tokens 8 --decode-tokens 2 \
            --repeats 1 >/dev/null
        for spin in 0 1; do
            COLIBRI_SWARM_SPIN=$spin python3 bench/engine.py --model "$f" --threads "$threads" \
                --engines colibri,llamabench --llama-bench "$LLAMA_BENCH" --prompt-tokens 64 --decode-tokens 32 \
                --repeats 3 >"$out/${kind}_${type}_spin${spin}.json"
        done
    done
done
echo "results in $out"
