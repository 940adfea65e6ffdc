#!/usr/bin/env bash
# The whole head-to-head measurement in one command; results as files under $OUT.
#
#   OUT=<results dir> bash bench/gpu_bench.sh [CHECKPOINT_DIR]        (default models/tiny-dsv3-mtp)
#
# Run from the repository root. Stages, each under its own time limit; a stage that fails or runs out
# of time is logged and the others still run:
#   engine      (on a GPU, only when BENCH_ONLY names it) bench/engine_overhead.py, the engine in process
#               with its decode graphs, 1 and 32 prompts, k = 0 and 3, model steps compiled and not
#               (BENCH_ENGINE_COMPILED=0: not compiled only), then k = 0 and 3 with --overlap (speculative steps
#               chained): $OUT/engine/
#   engine_thread  (on a GPU, only when BENCH_ONLY names it) bench/engine_overhead.py as the local-hops server
#               steps (64 slots, --overlap, compiled with BENCH_COMPILE=1), 1 prompt, k = BENCH_ENGINE_DRAFTS (default
#               0,0,3), on the main thread and on a second thread (--thread; BENCH_ENGINE_WHERE="main" or "thread" for
#               one): $OUT/engine/served_shape_{main,thread}.json; with BENCH_ENGINE_PROFILE=1 also torch.profiler's op
#               table of the last k's run (then timed under the profiler) as served_shape_{main,thread}_ops.txt
#   engine_arrivals  (only when BENCH_ONLY names it) bench/engine_overhead.py with requests arriving: 32 closed-loop
#               streams of BENCH_ARRIVALS requests (default 4), streamed every 4 tokens, overlapped, stepping on a
#               second thread, graphed (compiled with BENCH_COMPILE=1; null replays on CPU); with
#               BENCH_ENGINE_CODE=DIR, in turns with DIR's engine (an earlier commit's tree), BENCH_ENGINE_ROUNDS
#               rounds (default 2): $OUT/engine/arrivals_{this,code}_<round>.json
#   load_time   (on a GPU, only when BENCH_ONLY names it) bench/load_time.py: seconds to a ready server whose
#               graphs capture compiled steps (--compile-graphs, local hops), with and without the compile
#               cache the export ships: $OUT/load_time.json
#   warm_up     (only when BENCH_ONLY names it) bench/warm_up.py: each step's compile at load in process (empty
#               inductor cache), then the variants the decode graphs' shapes add: $OUT/warm_up.json
#   compile_parity  (on a GPU, only when BENCH_ONLY names it) bench/compile_parity.py: the export's parity
#               check of torch.compile'd steps per dtype:moe (BENCH_COMPILE_PARITY_CASES): $OUT/compile_parity.json
#   export      triton-mtp export of the checkpoint into a model repository (BENCH_FORMAT; on a GPU eager,
#               whose decode calls the served models replay from CUDA graphs: --no-compile, or with
#               BENCH_COMPILE=1 also --compile-graphs; on CPU torchscript)
#   capture     bench/capture_check.py (on a GPU): whether the served decode graphs capture over the exported
#               artifacts outside Triton, and their batch-1 call time
#   triton      bench/triton_bench.py against an embedded tritonserver: batch 1 plain and k=1..4, then the
#               concurrency sweep for plain and the best k
#   export_local, triton_local  the same with `export --hops local` (spec_decode runs the workers itself;
#               not with BENCH_REPOSITORY)
#   profile     (only when BENCH_ONLY names it) bench/served_profile.py over the local-hops repository: py-spy
#               samples of spec_decode's stub while one stream decodes, k = BENCH_PROFILE_K (default 0 and 3, or
#               the export's largest k) over BENCH_PROFILE_STREAMS concurrent streams (default 1), with py-spy from
#               PATH or .bundle/wheels/py_spy-*.whl: $OUT/profile/
#   triton_local_ab  with BENCH_AB="key=value[,key=value] ..." (BENCH_ONLY naming it, where set): bench/triton_ab.py,
#               the local-hops export and one model per change (those spec_decode parameters changed) served side by
#               side by one server, measured in turns: k in BENCH_AB_K (default 0,3, or the export's largest k), at
#               BENCH_AB_STREAMS (default 1,32), BENCH_AB_REQUESTS_PER_STREAM requests per stream (default 8),
#               BENCH_AB_ROUNDS rounds (default 2): $OUT/ab.json
#   chain_check (on a GPU, only when BENCH_ONLY names it) bench/chain_check.py: chained steps replayed from the
#               chain graph emit what eager workers and the graphs without it emit: $OUT/chain_check.json
#   graph_time  (on a GPU, only when BENCH_ONLY names it) bench/graph_time.py: GPU time of one target graph replay
#               per batch (BENCH_GRAPH_BATCH, default 1,32) for the served compiled build: $OUT/graph_time.json
#   fused_moe   (on a GPU, only when BENCH_ONLY names it) bench/fused_moe.py: one grouped MoE layer at decode sizes,
#               the grouped GEMMs against export/fused_moe.py's kernels (BENCH_FUSED_MOE_ARGS: more arguments):
#               $OUT/fused_moe.json
#   decode_kernels  (on a GPU, only when BENCH_ONLY names it) bench/decode_kernels.py: export/linear.py's kernel
#               against cuBLAS per linear shape and configuration, export/latent_attention.py's kernels against the
#               compiled eager attention per configuration (BENCH_DECODE_KERNELS_ARGS: more arguments):
#               $OUT/decode_kernels.json
#   standalone  bench/standalone.py: the same checkpoint in one process, steps as captured CUDA graphs,
#               with and without speculation
#   hf_generate bench/hf_generate.py: transformers generate(do_sample=False), the same checkpoint
#   realistic   bench/realistic.py: the DeepSeek-V2-Lite-shaped decode step against its bandwidth floor, dense
#               and grouped MoE, the grouped one through its GEMMs and through the decode kernels
#               (BENCH_REALISTIC_GRAPHS=reduce-overhead: steps compiled, then graphed; BENCH_REALISTIC_ARGS: more
#               arguments), and the kernel table of one timed step of the last variant: $OUT/realistic_profile.txt
#   standalone_compiled  the standalone loop under torch.compile(mode="reduce-overhead"), with the time left
# Every stage is cut to what BENCH_DEADLINE_S (default 540) leaves, and the report is rewritten after each.
# then bench/report.py writes $OUT/results.json, results.md, sweep.png, acceptance.png (with matplotlib);
# $OUT/bench.log has every stage's output and $OUT/server.log, server_local.log the servers' logs.
#
# Where the project is not pip-installed (the GPU host) a PYTHONPATH shim of symlinks stands in for it.
# Where tritonserver or tritonclient are not installed, they come from .bundle/: tritonserver.tar.xz
# (triton-bundle/{bin,backends,lib}, linked into the layout of nvidia-pytriton's wheel, which is where
# serving/server.py looks) and wheels/ (tritonclient, python-rapidjson, numpy 1.26.4; into --target dirs). The Python backend stub sees neither PYTHONPATH nor numpy < 2, so while the triton stage
# runs a .pth file in this interpreter's site-packages puts numpy 1.26 and the shim first on its path.
#
# BENCH_SKIP="STAGE ...": leave those stages out (their results then come from an earlier run);
# BENCH_ONLY="STAGE ...": run only those. BENCH_RESPONSE_THREADS=N exports with --response-threads N,
# BENCH_STREAM_INTERVAL=N with --stream-interval N, BENCH_SPEC_DISABLE_ROWS=N with --spec-disable-rows N,
# BENCH_NO_OVERLAP=1 with --no-overlap, BENCH_DECODE_STEPS=N the local-hops export with --decode-steps N.
# BENCH_KERNELS=NAMES exports with --decode-kernels NAMES (export/kernel_choice.py: linear, attention, router).
# BENCH_MOE=grouped|dense picks the routed experts' kind (export/moe.py) of the export, standalone and engine
# stages (default: the export's default).
# BENCH_SMOKE=1: tiny sizes on CPU (fp32, eager, 2 prompts of 16 tokens, k=1,2, streams 1,2; a synthetic
# checkpoint when none is given) so the whole script is known to run. BENCH_REPOSITORY=<dir> serves an
# existing repository instead of exporting. BENCH_LOCAL_REPOSITORY=<dir>: the local-hops export goes there and
# stays; a later run on the same machine given the same dir serves it without exporting again (A/B runs
# after a full one). BENCH_FORMAT picks the export format. BENCH_REQUESTS_PER_STREAM=N: requests per stream
# of each concurrency level of the triton stages (default 2; at 32 streams 2 make a level about 0.5 s long).
set -uo pipefail
: "${OUT:?set OUT to the results directory}"
repo=$(pwd)
checkpoint=${1:-}
[ -n "$checkpoint" ] && { checkpoint=$(cd "$checkpoint" && pwd) || { echo "checkpoint directory not found: $1"; exit 1; }; }
[ -n "${BENCH_REPOSITORY:-}" ] && BENCH_REPOSITORY=$(cd "$BENCH_REPOSITORY" && pwd)
[ -n "${BENCH_LOCAL_REPOSITORY:-}" ] && BENCH_LOCAL_REPOSITORY=$(realpath -m "$BENCH_LOCAL_REPOSITORY")
if [ -n "${BENCH_AB:-}" ]; then  # a relative code=DIR is relative to here: the stages run from the shim below
    read -ra changes <<<"$BENCH_AB"
    for c in "${!changes[@]}"; do
        IFS=, read -ra items <<<"${changes[$c]}"
        for i in "${!items[@]}"; do
            [[ ${items[$i]} == code=?* ]] && items[$i]=code=$(realpath -m "${items[$i]#code=}")
        done
        changes[$c]=$(IFS=,; printf '%s' "${items[*]}")
    done
    BENCH_AB=${changes[*]}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d)
stages=$work/stages
mkdir -p "$stages"
log=$OUT/bench.log
: >"$log"
say() { echo "[gpu_bench $(date +%T)] $*" | tee -a "$log"; }
pth=""
cleanup() { [ -n "$pth" ] && rm -f "$pth"; rm -rf "$work"; }
trap cleanup EXIT

# ---- the project, tritonclient and tritonserver, importable without installing -----------------------
make_shim() {  # make_shim DIR TREE: DIR/triton_mtp laid out as the installed package, of TREE's code (this bench)
    mkdir -p "$1/triton_mtp"
    for f in "$2"/triton_mtp/*.py; do ln -s "$f" "$1/triton_mtp/"; done
    for pkg in export serving client train model_repository; do ln -s "$2/$pkg" "$1/triton_mtp/$pkg"; done
    ln -s "$repo/bench" "$1/triton_mtp/bench"
}
shim=$work/shim
make_shim "$shim" "$repo"
ln -s "$repo/bench" "$shim/bench"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
cd "$shim"  # from the repository root, `python -m` would import its bare triton_mtp/ folder, not the shim
pyver=$(python -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
stub_paths=()
if ! python -c 'import tritonclient.grpc' 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --target "$work/site" "$repo"/.bundle/wheels/tritonclient-*.whl \
        "$repo"/.bundle/wheels/python_rapidjson-*.whl >>"$log" 2>&1
    export PYTHONPATH="$PYTHONPATH:$work/site"
fi
if ! python -c 'import pytriton' 2>/dev/null; then
    tar -xJf "$repo/.bundle/tritonserver.tar.xz" -C "$work"
    bundle=$work/triton-bundle
    server=$shim/pytriton/tritonserver
    mkdir -p "$server/python_backend_stubs/$pyver" "$shim/nvidia_pytriton-0.7.0.dist-info"
    ln -s "$bundle/bin" "$server/bin"
    ln -s "$bundle/backends" "$server/backends"
    ln -s "$bundle/backends/python/triton_python_backend_stub" "$server/python_backend_stubs/$pyver/"
    ln -s "$bundle/lib" "$shim/nvidia_pytriton.libs"
    printf 'Metadata-Version: 2.1\nName: nvidia-pytriton\nVersion: 0.7.0\n' >"$shim/nvidia_pytriton-0.7.0.dist-info/METADATA"
    export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ "$(python -c 'import numpy; print(numpy.__version__.split(".")[0])')" -ge 2 ]; then
    python -m pip install -q --no-index --no-deps --target "$work/numpy126" "$repo"/.bundle/wheels/numpy-1.26.4-*.whl >>"$log" 2>&1
    stub_paths+=("$work/numpy126")
fi
(cd / && env -u PYTHONPATH python -c 'import triton_mtp.serving' 2>/dev/null) || stub_paths+=("$shim")
stub_path_on() {  # the .pth that reaches the backend stub; removed again by stub_path_off / on exit
    [ ${#stub_paths[@]} -eq 0 ] && return
    pth=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_triton_mtp_bench.pth
    python - "$pth" "${stub_paths[@]}" <<'PY'
import pathlib, sys
pathlib.Path(sys.argv[1]).write_text(f"import sys; sys.path[:0] = {sys.argv[2:]!r}\n")
PY
}
stub_path_off() { [ -n "$pth" ] && rm -f "$pth"; pth=""; }

# ---- sizes -----------------------------------------------------------------------------------------
if [ "${BENCH_SMOKE:-0}" = 1 ]; then
    device=cpu dtype=fp32 graphs=eager default_format=torchscript deadline=3000 prompts=2 prompt_tokens=16 max_tokens=16 drafts=1,2 streams=1,2 ab_streams=1,2
    hf_prompts=1 warmup=1 limit=400 realistic_args=(--layers 2 --hidden 128 --experts 8 --vocab 512 --context 32 --repeats 3
                                            --copy-bytes 4000000 --graphs eager)
    if [ -z "$checkpoint" ]; then
        checkpoint=$work/checkpoint
        python -c "import sys; sys.path.insert(0, '$repo/tests'); from tiny_config import tiny_config; \
from triton_mtp.export.synthetic import write_checkpoint; write_checkpoint('$checkpoint', tiny_config())" >>"$log" 2>&1
    fi
else
    device=cuda dtype=bf16 graphs=cudagraph default_format=eager prompts=8 prompt_tokens=128 max_tokens=128 drafts=1,2,3,4
    streams=1,2,4,8,16,32,64 ab_streams=1,32 hf_prompts=4 warmup=1 limit=0 realistic_args=(--layers "${BENCH_REALISTIC_LAYERS:-27}" --context 512
                                                   --graphs "${BENCH_REALISTIC_GRAPHS:-cudagraph}" ${BENCH_REALISTIC_ARGS:-})
fi
checkpoint=${checkpoint:-$repo/models/tiny-dsv3-mtp}
format=${BENCH_FORMAT:-$default_format}
format_args=()
[ "$format" = eager ] && format_args=(--no-compile)  # graphs of uncompiled steps ...
[ "$format" = eager ] && [ "${BENCH_COMPILE:-0}" = 1 ] && format_args+=(--compile-graphs)  # ... or of compiled ones
[ -n "${BENCH_RESPONSE_THREADS:-}" ] && format_args+=(--response-threads "$BENCH_RESPONSE_THREADS")
[ -n "${BENCH_STREAM_INTERVAL:-}" ] && format_args+=(--stream-interval "$BENCH_STREAM_INTERVAL")
[ -n "${BENCH_SPEC_DISABLE_ROWS:-}" ] && format_args+=(--spec-disable-rows "$BENCH_SPEC_DISABLE_ROWS")
[ "${BENCH_NO_OVERLAP:-0}" = 1 ] && format_args+=(--no-overlap)
moe_args=()
[ -n "${BENCH_MOE:-}" ] && moe_args=(--moe "$BENCH_MOE")
format_args+=("${moe_args[@]}")
[ -n "${BENCH_KERNELS:-}" ] && format_args+=(--decode-kernels "$BENCH_KERNELS")
max_draft=${drafts##*,}
max_seq_len=$(python -c "from bench.common import bench_max_seq_len as m; print(m($prompt_tokens, $max_tokens, $max_draft))")
common=(--checkpoint "$checkpoint" --prompts "$prompts" --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens")

: "${deadline:=${BENCH_DEADLINE_S:-540}}"  # the whole script, report included, ends before this many seconds
stage() {  # stage NAME SECONDS CMD...: run under a time limit (cut to what the deadline leaves), log, report
    local name=$1 seconds=$2
    shift 2
    if [[ " ${BENCH_SKIP:-} " == *" $name "* ]] || { [ -n "${BENCH_ONLY:-}" ] && [[ " $BENCH_ONLY " != *" $name "* ]]; }; then
        say "stage $name skipped: BENCH_SKIP / BENCH_ONLY"
        return 1
    fi
    [ "$limit" -gt 0 ] && seconds=$limit
    local left=$((deadline - SECONDS - 30))
    [ "$seconds" -gt "$left" ] && seconds=$left
    if [ "$seconds" -lt 10 ]; then
        say "stage $name skipped: the deadline of ${deadline}s is near"
        return 1
    fi
    say "stage $name (limit ${seconds}s): $*"
    local start=$SECONDS
    timeout --kill-after=15 "$seconds" "$@" >>"$log" 2>&1
    local rc=$?
    say "stage $name: exit $rc after $((SECONDS - start))s"
    python -m bench.report --stages "$stages" --out "$OUT" >/dev/null 2>>"$log"  # results so far, in case of a kill
    return $rc
}

python - >>"$log" 2>&1 <<'PY'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
say "checkpoint $checkpoint, device $device, dtype $dtype, max_seq_len $max_seq_len"

# ---- stages ----------------------------------------------------------------------------------------
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" engine "* ]]; then  # on request: the engine in process,
    # graphed, per batch size, model steps compiled or not (compiling takes minutes of the deadline)
    mkdir -p "$OUT/engine"
    for b in 1 32; do
        compiled_modes=("" --compile)
        [ "${BENCH_ENGINE_COMPILED:-1}" = 0 ] && compiled_modes=("")
        for compiled in "${compiled_modes[@]}"; do
            stage engine "${BENCH_ENGINE_S:-120}" python -m bench.engine_overhead --checkpoint "$checkpoint" \
                --device cuda --dtype "$dtype" --graphs $compiled --prompts "$b" --prompt-tokens "$prompt_tokens" \
                --max-tokens "$max_tokens" --draft-tokens 0,3 "${moe_args[@]}" --out "$OUT/engine/graphs${compiled:+_compiled}_b$b.json"
            stage engine "${BENCH_ENGINE_S:-120}" python -m bench.engine_overhead --checkpoint "$checkpoint" \
                --device cuda --dtype "$dtype" --graphs $compiled --overlap --prompts "$b" --prompt-tokens "$prompt_tokens" \
                --max-tokens "$max_tokens" --draft-tokens 0,3 "${moe_args[@]}" \
                --out "$OUT/engine/graphs${compiled:+_compiled}_overlap_b$b.json"
        done
    done
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" engine_thread "* ]]; then  # on request: the engine in process
    # as the local-hops server runs it (64 slots, overlap, stepping on a second thread) and on the main thread
    mkdir -p "$OUT/engine"
    compiled=()
    [ "${BENCH_COMPILE:-0}" = 1 ] && compiled=(--compile)
    for where in ${BENCH_ENGINE_WHERE:-main thread}; do
        thread=() profile=()
        [ "$where" = thread ] && thread=(--thread)
        [ "${BENCH_ENGINE_PROFILE:-0}" = 1 ] && profile=(--profile "$OUT/engine/served_shape_${where}_ops.txt")
        stage engine_thread "${BENCH_ENGINE_S:-120}" python -m bench.engine_overhead --checkpoint "$checkpoint" \
            --device cuda --dtype "$dtype" --graphs "${compiled[@]}" --overlap "${thread[@]}" --prompts 1 --max-slots 64 \
            --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens" --draft-tokens "${BENCH_ENGINE_DRAFTS:-0,0,3}" \
            "${moe_args[@]}" "${profile[@]}" --out "$OUT/engine/served_shape_$where.json"
    done
fi
if [[ " ${BENCH_ONLY:-} " == *" engine_arrivals "* ]]; then  # on request: requests arriving, in process; with
    # BENCH_ENGINE_CODE=DIR also the engine of DIR's tree (`git archive <commit> | tar -x -C DIR`), in turns
    mkdir -p "$OUT/engine"
    trees=(this)
    if [ -n "${BENCH_ENGINE_CODE:-}" ]; then  # DIR's packages through a shim like the project's (this tree's bench)
        code_shim=$work/code_shim
        make_shim "$code_shim" "$BENCH_ENGINE_CODE"
        trees+=(code)
    fi
    replays=(--graphs)
    [ "$device" = cpu ] && replays=(--graphs --null-replays)
    [ "${BENCH_COMPILE:-0}" = 1 ] && [ "$device" = cuda ] && replays+=(--compile)
    for round in $(seq "${BENCH_ENGINE_ROUNDS:-2}"); do
        for tree in "${trees[@]}"; do
            from=$shim
            [ "$tree" = code ] && from=$code_shim
            # from inside its shim: `python -m` puts the working directory first on the path
            stage engine_arrivals "${BENCH_ENGINE_S:-90}" bash -c 'cd "$0" && PYTHONPATH="$0" exec "$@"' "$from" \
                python -m triton_mtp.bench.engine_overhead --checkpoint "$checkpoint" --device "$device" \
                --dtype "$dtype" "${replays[@]}" --overlap --thread --prompts 32 --max-slots 64 \
                --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens" --requests-per-prompt "${BENCH_ARRIVALS:-4}" \
                --draft-tokens 0 --stream 4 "${moe_args[@]}" --out "$OUT/engine/arrivals_${tree}_$round.json"
        done
    done
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" compile_parity "* ]]; then  # on request: minutes of compiling
    stage compile_parity "${BENCH_COMPILE_PARITY_S:-400}" python -m bench.compile_parity --checkpoint "$checkpoint" \
        --device cuda --cases "${BENCH_COMPILE_PARITY_CASES:-bf16:dense,bf16:grouped,fp32:dense}" \
        --verify-tokens $((max_draft + 1)) --out "$OUT/compile_parity.json"
fi
if [[ " ${BENCH_ONLY:-} " == *" warm_up "* ]]; then  # on request: minutes of compiling
    stage warm_up "${BENCH_WARM_UP_S:-300}" python -m bench.warm_up --checkpoint "$checkpoint" --device "$device" \
        --dtype "$dtype" --served-shapes --max-draft-tokens "$max_draft" --max-seq-len "$max_seq_len" \
        --out "$OUT/warm_up.json"
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" load_time "* ]]; then  # on request: minutes of compiling
    stub_path_on
    stage load_time "${BENCH_LOAD_TIME_S:-500}" python -m bench.load_time --checkpoint "$checkpoint" --device cuda \
        --dtype "$dtype" --compile-graphs --repeats 1 --max-slots 64 --max-seq-len "$max_seq_len" \
        --out "$OUT/load_time.json"
    stub_path_off
fi
repository=${BENCH_REPOSITORY:-$work/repository}
export_cmd=(python -m triton_mtp.cli export --checkpoint "$checkpoint" --format "$format" "${format_args[@]}"
            --device "$device" --dtype "$dtype" --max-slots 64 --max-seq-len "$max_seq_len"
            --max-draft-tokens "$max_draft" --max-queue-size 256)
if [ -z "${BENCH_REPOSITORY:-}" ]; then
    stage export "${BENCH_EXPORT_S:-90}" "${export_cmd[@]}" --repository "$repository"
fi
triton_cmd=(python -m bench.triton_bench "${common[@]}" --draft-tokens "$drafts" --concurrency "$streams" --warmup "$warmup"
            --requests-per-stream "${BENCH_REQUESTS_PER_STREAM:-2}")
if [ -d "$repository/spec_decode" ] && [ "$device" = cuda ]; then
    stage capture "${BENCH_CAPTURE_S:-90}" python -m bench.capture_check --repository "$repository" \
        --out "$stages/capture.json"
fi
if [ -d "$repository/spec_decode" ]; then
    stub_path_on
    stage triton "${BENCH_TRITON_S:-240}" "${triton_cmd[@]}" --repository "$repository" --out "$stages/triton.json" \
        --server-log "$OUT/server.log"
    stub_path_off
else
    say "stage triton skipped: no model repository at $repository"
fi
local_repository=${BENCH_LOCAL_REPOSITORY:-$work/repository_local}  # the same export with --hops local: the workers inside spec_decode
if [ -n "${BENCH_REPOSITORY:-}" ]; then
    say "stage export_local skipped: BENCH_REPOSITORY serves a given repository"
elif [ -n "${BENCH_LOCAL_REPOSITORY:-}" ] && [ -f "$local_repository/spec_decode/config.pbtxt" ]; then
    say "stage export_local skipped: BENCH_LOCAL_REPOSITORY holds an earlier run's export"
else
    local_args=()  # multi-step decoding runs in local hops alone
    [ -n "${BENCH_DECODE_STEPS:-}" ] && local_args=(--decode-steps "$BENCH_DECODE_STEPS")
    stage export_local "${BENCH_EXPORT_S:-90}" "${export_cmd[@]}" --repository "$local_repository" --hops local \
        "${local_args[@]}"
fi
if [ -d "$local_repository/spec_decode" ]; then
    stub_path_on
    stage triton_local "${BENCH_TRITON_S:-240}" "${triton_cmd[@]}" --repository "$local_repository" \
        --out "$stages/triton_local.json" --server-log "$OUT/server_local.log"
    stub_path_off
fi
if [ -d "$local_repository/spec_decode" ] && [ -n "${BENCH_AB:-}" ]; then  # the same export, parameters changed
    ab_changes=()
    for change in $BENCH_AB; do ab_changes+=(--change "$change"); done
    stub_path_on
    stage triton_local_ab "${BENCH_TRITON_AB_S:-240}" python -m bench.triton_ab "${common[@]}" "${ab_changes[@]}" \
        --draft-tokens "${BENCH_AB_K:-0,$((max_draft < 3 ? max_draft : 3))}" --concurrency "${BENCH_AB_STREAMS:-$ab_streams}" \
        --requests-per-stream "${BENCH_AB_REQUESTS_PER_STREAM:-8}" --rounds "${BENCH_AB_ROUNDS:-2}" \
        --repository "$local_repository" --out "$OUT/ab.json" --server-log "$OUT/server_ab.log"
    stub_path_off
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" chain_check "* ]]; then  # on request
    stage chain_check "${BENCH_CHAIN_CHECK_S:-90}" python -m bench.chain_check --checkpoint "$checkpoint" \
        --out "$OUT/chain_check.json"
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" graph_time "* ]]; then  # on request: a compile
    stage graph_time "${BENCH_GRAPH_TIME_S:-150}" python -m bench.graph_time --checkpoint "$checkpoint" \
        --max-draft "$max_draft" --max-seq-len "$max_seq_len" --batch "${BENCH_GRAPH_BATCH:-1,32}" --builds served \
        --out "$OUT/graph_time.json"
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" decode_kernels "* ]]; then  # on request
    stage decode_kernels "${BENCH_DECODE_KERNELS_S:-200}" python -m bench.decode_kernels --out "$OUT/decode_kernels.json" \
        ${BENCH_DECODE_KERNELS_ARGS:-}
fi
if [ "$device" = cuda ] && [[ " ${BENCH_ONLY:-} " == *" fused_moe "* ]]; then  # on request
    stage fused_moe "${BENCH_FUSED_MOE_S:-120}" python -m bench.fused_moe --out "$OUT/fused_moe.json" \
        ${BENCH_FUSED_MOE_ARGS:-}
fi
if [ -d "$local_repository/spec_decode" ] && [[ " ${BENCH_ONLY:-} " == *" profile "* ]]; then  # on request
    py_spy=$(command -v py-spy)
    if [ -z "$py_spy" ]; then
        python -m pip install -q --no-index --no-deps --target "$work/py-spy" "$repo"/.bundle/wheels/py_spy-*.whl >>"$log" 2>&1
        py_spy=$work/py-spy/bin/py-spy
    fi
    stub_path_on
    stage profile "${BENCH_PROFILE_S:-150}" python -m bench.served_profile "${common[@]}" --repository "$local_repository" \
        --py-spy "$py_spy" -k "${BENCH_PROFILE_K:-0,$((max_draft < 3 ? max_draft : 3))}" \
        --streams "${BENCH_PROFILE_STREAMS:-1}" --out "$OUT/profile"
    stub_path_off
fi
stage standalone "${BENCH_STANDALONE_S:-75}" python -m bench.standalone "${common[@]}" --out "$stages/standalone.json" \
    --device "$device" --dtype "$dtype" --graphs "$graphs" --draft-tokens "$drafts" "${moe_args[@]}"
stage hf_generate "${BENCH_HF_S:-45}" python -m bench.hf_generate --checkpoint "$checkpoint" --prompts "$hf_prompts" \
    --prompt-tokens "$prompt_tokens" --max-tokens "$max_tokens" --out "$stages/hf_generate.json" \
    --device "$device" --dtype "$dtype"
stage realistic "${BENCH_REALISTIC_S:-75}" python -m bench.realistic --out "$stages/realistic.json" --device "$device" \
    "${realistic_args[@]}" --profile "$OUT/realistic_profile.txt"
if [ "$device" = cuda ]; then  # compiling may take minutes: last, with what time is left
    stage standalone_compiled "${BENCH_COMPILED_S:-200}" python -m bench.standalone "${common[@]}" \
        --out "$stages/standalone_compiled.json" --device "$device" --dtype "$dtype" --graphs reduce-overhead \
        --draft-tokens "$drafts" "${moe_args[@]}"
fi
python -m bench.report --stages "$stages" --out "$OUT" 2>&1 | tee -a "$log" || { say "report failed"; exit 1; }
ls -la "$OUT" | tee -a "$log"
