#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (llama-server) from the llama.cpp tree vendored in the pinned
# llama-cpp-python sdist, and install it next to the environment's Python: .venv/bin/llama-server,
# with its build record .venv/bin/llama-server.json. The same tree as the binding means the same slot
# file format as the one stagereplay parses. Run by envs/setup.sh when the spec names this script
# (SPEC=envs/llamaserver.txt); quick when the installed record already matches this build.
# The sources and the CMake build stay in build/llama-server/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
work="${LLAMA_SERVER_BUILD_DIR:-build/llama-server}"
version=$("$python" -c 'from importlib.metadata import version; print(version("llama-cpp-python"))')
prefix=$("$python" -c 'import sys; print(sys.prefix)')
binary="$prefix/bin/llama-server"
record="$binary.json"
# Static (a single file to install), optimised for this CPU like the binding's own build (GGML_NATIVE on),
# no web UI (the prebuilt one is a download), no HTTPS, only the server target.
flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF
)
# What the compiler's -march=native turns on here: the CPU features the kernels are built for.
features=$(echo | cc -march=native -dM -E - |
  sed -nE 's/^#define __((AVX|AMX|FMA|F16C|SSE|SSSE|BMI|FP16|ARM_FEATURE_)[A-Z0-9_]*)__ 1$/\1/p' | sort | tr '\n' ' ')
march=$(cc -march=native -Q --help=target 2>/dev/null | sed -nE 's/^\s+-march=\s+(\S+).*/\1/p' | head -1)

"$python" - "$record" "$binary" "$version" "${flags[*]}" "$features" <<'EOF' && { echo "llama-server for llama-cpp-python $version already built: $binary"; exit 0; }
import json, os, sys
record, binary, version, flags, features = sys.argv[1:]
try:
    found = json.load(open(record))
except (OSError, ValueError):
    sys.exit(1)
same = found.get("llama_cpp_python") == version and found.get("cmake_flags") == flags.split() and found.get("cpu_features") == features.split()
sys.exit(0 if same and os.access(binary, os.X_OK) else 1)
EOF

# A built server is kept outside the checkout, keyed by what decides its bytes (binding version, flags, CPU
# features), so a fresh clone (CI) installs it in a second instead of compiling for ten minutes.
key=$(printf '%s\n' "$version" "${flags[*]}" "$features" | sha256sum | cut -c1-16)
cache="${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stagereplay/llama-server}/$version-$key"
if [ -x "$cache/llama-server" ] && [ -f "$cache/llama-server.json" ]; then
  install -m 755 "$cache/llama-server" "$binary.tmp" && mv "$binary.tmp" "$binary"
  cp "$cache/llama-server.json" "$record.tmp" && mv "$record.tmp" "$record"
  echo "llama-server for llama-cpp-python $version installed from the build cache: $cache"
  exit 0
fi

start=$(date +%s)
mkdir -p "$work"
"$python" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
  -d "$work/sdist" "llama-cpp-python==$version"
source="$work/llama_cpp_python-$version"
[ -d "$source" ] || tar -xzf "$work/sdist/llama_cpp_python-$version.tar.gz" -C "$work"
# The vendored commit: the sdist carries the tree's git metadata (a shallow clone, so llama.cpp's own
# build number comes out as 1, not upstream's); without git, the commit its changelog names for this release.
if commit=$(git -C "$source/vendor/llama.cpp" rev-parse HEAD 2>/dev/null); then
  commit_source="git metadata of the vendored tree in the llama-cpp-python $version sdist (a shallow clone)"
else
  commit=$(awk -v v="## [$version]" '$0 == v {on=1; next} /^## \[/ {on=0} on' "$source/CHANGELOG.md" |
    sed -nE 's/.*llama\.cpp@([0-9a-f]{7,40}).*/\1/p' | head -1)
  commit="${commit:-unknown}"
  commit_source="CHANGELOG.md of the llama-cpp-python $version sdist"
fi
cmake -S "$source/vendor/llama.cpp" -B "$work/cmake" "${flags[@]}" -DLLAMA_BUILD_COMMIT="$commit" >"$work/cmake.log" 2>&1 ||
  { tail -20 "$work/cmake.log"; echo "llama-server did not configure: see $work/cmake.log"; exit 1; }
nice -n 10 cmake --build "$work/cmake" --target llama-server -j"${JOBS:-$(nproc)}" >"$work/build.log" ||
  { tail -20 "$work/build.log"; echo "llama-server did not build: see $work/build.log"; exit 1; }
install -m 755 "$work/cmake/bin/llama-server" "$binary.tmp"
mv "$binary.tmp" "$binary"
build_info=$("$binary" --version 2>&1 | tr '\n' ' ' | sed 's/ *$//')
"$python" - "$record" "$version" "$commit" "$commit_source" "${flags[*]}" "$features" "$march" "$build_info" \
  "$(($(date +%s) - start))" <<'EOF'
import json, os, sys
record, version, commit, commit_source, flags, features, march, build_info, seconds = sys.argv[1:]
data = {
    "llama_cpp_python": version,
    "llama_cpp_commit": commit,
    "llama_cpp_commit_source": commit_source,
    "version_output": build_info,
    "cmake_flags": flags.split(),
    "march_native": march,
    "cpu_features": features.split(),
    "build_seconds": int(seconds),
}
with open(record + ".tmp", "w") as handle:
    json.dump(data, handle, indent=1)
    handle.write("\n")
os.replace(record + ".tmp", record)
EOF
mkdir -p "$cache"
install -m 755 "$binary" "$cache/llama-server.tmp" && mv "$cache/llama-server.tmp" "$cache/llama-server"
cp "$record" "$cache/llama-server.json.tmp" && mv "$cache/llama-server.json.tmp" "$cache/llama-server.json"
echo "llama-server built for llama-cpp-python $version ($commit) in $(($(date +%s) - start)) s: $binary"
