#!/usr/bin/env bash
# Install perf_analyzer for this host without touching the environment's tritonclient:
#   bench/perf_analyzer/install.sh [DIR]      (default build/tools)  ->  DIR/bin/perf_analyzer
# PyPI's perf-analyzer package is a placeholder; the tritonclient 2.48.0 wheel carries a real binary
# (later wheels need glibc 2.38 or ship none). It needs libb64 (Debian libb64-0d) and libcudart 12
# (the nvidia-cuda-runtime-cu12 wheel), even on a host without a GPU.
set -euo pipefail
DIR=$(realpath -m "${1:-build/tools}")
if "$DIR/bin/perf_analyzer" --version >/dev/null 2>&1; then
    exit 0
fi
if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
    echo "install.sh: libb64.so.0d not found: apt-get install -y libb64-0d" >&2
    exit 1
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps -d "$WORK" tritonclient==2.48.0 nvidia-cuda-runtime-cu12
python3 -m zipfile -e "$WORK"/tritonclient-2.48.0-*.whl "$WORK/tritonclient"
python3 -m zipfile -e "$WORK"/nvidia_cuda_runtime_cu12-*.whl "$WORK/cudart"
mkdir -p "$DIR/bin" "$DIR/libexec" "$DIR/lib"
install -m 755 "$WORK/tritonclient/tritonclient-2.48.0.data/data/bin/perf_analyzer" "$DIR/libexec/perf_analyzer"
cp "$WORK"/cudart/nvidia/cuda_runtime/lib/libcudart.so.12 "$DIR/lib/"
cat > "$DIR/bin/perf_analyzer" <<WRAPPER
#!/bin/sh
LD_LIBRARY_PATH="$DIR/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$DIR/libexec/perf_analyzer" "\$@"
WRAPPER
chmod 755 "$DIR/bin/perf_analyzer"
"$DIR/bin/perf_analyzer" --version >/dev/null
