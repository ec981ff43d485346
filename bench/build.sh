#!/bin/sh
# Builds the plain-C baselines into bench/bin/ (gitignored): the `baselines`
# program, the same source as an in-process library (libbaselines.so), and the
# per-call latency baselines of bench_tiny.py (`tiny`).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$here/bin"
cc=${CC:-cc}
$cc -std=c11 -O2 -pthread -Wall -Wextra -o "$here/bin/baselines" "$here/c/baselines.c"
$cc -std=c11 -O2 -pthread -Wall -Wextra -Wno-unused-function -Wno-unused-variable -fPIC -shared -DBASELINES_LIB -o "$here/bin/libbaselines.so" "$here/c/baselines.c"
$cc -std=c11 -O2 -Wall -Wextra -o "$here/bin/tiny" "$here/c/tiny.c"
echo "built $here/bin/baselines $here/bin/libbaselines.so $here/bin/tiny"
