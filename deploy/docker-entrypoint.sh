#!/bin/sh
# The image's entry point: checks that the store's directory can be written by the user the container
# runs as, then runs its arguments (`tokentape serve ...`) in its place, so that `docker stop`'s SIGTERM
# reaches the gateway, which drains.
#
# A named volume (`-v tokentape-data:/data`) starts owned by the image's user, `tokentape`. A host
# directory mounted there keeps its owner on the host: one owned by root cannot be written, and SQLite
# would fail on the first request. Said here, at start-up, with the two ways out.
set -eu

data="${TOKENTAPE_DATA_DIR:-/data}"
probe="$data/.tokentape-write-check.$$"
if ! (: >"$probe") 2>/dev/null; then
    owner=$(stat -c '%u:%g' "$data" 2>/dev/null || echo unknown)
    cat >&2 <<EOF
tokentape: cannot write to $data (owned by uid:gid $owner; this container runs as uid:gid $(id -u):$(id -g)).
The store (tokentape.sqlite3) lives there. Either:
  - give the directory to the image's user on the host:  sudo chown -R $(id -u):$(id -g) <host directory>
  - or run the container as the directory's owner:        docker run --user $owner ...
  - or use a named volume instead of a host directory:    -v tokentape-data:$data
EOF
    exit 1
fi
rm -f "$probe"

# A user given with --user may have no home directory; caches (Hugging Face's, tokentape's) go to /tmp then.
if [ -z "${HOME:-}" ] || ! [ -w "${HOME}" ]; then
    export HOME=/tmp/tokentape-home
    mkdir -p "$HOME"
fi

exec "$@"
