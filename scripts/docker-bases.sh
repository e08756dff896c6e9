#!/usr/bin/env bash
# Builds the base images Dockerfile and docker-compose.yml name — docker/bases/images lists them (Python,
# PostgreSQL 15, Redis 7, each pinned to a release) — from Debian bookworm's own packages, for a Docker engine that cannot pull from a registry
# (CI: tests/e2e/test_compose_stack.py). The production files are built unchanged on top of them.
#
#   DOCKER_HOST=unix:///path/docker.sock scripts/docker-bases.sh
#
# 1. `debootstrap --variant=minbase bookworm` into a temporary directory, with this machine's own CA
#    certificates (/usr/local/share/ca-certificates/*.crt) added, `docker import` as
#    trainboard-base/bookworm-rootfs (needs root and http://deb.debian.org);
# 2. docker/bases/{python,postgres,redis}/Dockerfile on top, tagged with the official names; each
#    provides the contract the official image gives (see the Dockerfiles' headers);
# 3. the four images saved to $TRAINBOARD_DOCKER_CACHE (default ~/.cache/trainboard-docker) as
#    bases-<hash>.tar, the hash taken over this script, docker/bases/ and those certificates; a later run with the same
#    hash only `docker load`s it (seconds instead of minutes), and an engine that has them already (each
#    image is labelled trainboard.bases=<hash>) is left as it is. Older tarballs are removed.
#
# Prints one line per phase with its duration. Exits non-zero on the first failure.
set -euo pipefail
export DOCKER_BUILDKIT=0  # the classic builder: Debian's engine has no buildx, and no build here needs BuildKit

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TRAINBOARD_DOCKER_CACHE:-$HOME/.cache/trainboard-docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# "<directory> <image>" lines of docker/bases/images (part of the hash below: docker/bases/).
mapfile -t BASES < <(grep -v '^#' "$ROOT/docker/bases/images" | grep -v '^[[:space:]]*$')
IMAGES=(trainboard-base/bookworm-rootfs)
for line in "${BASES[@]}"; do IMAGES+=("${line#* }"); done

# This machine's own trust anchors (a TLS-intercepting egress proxy's CA, a site CA): the bases trust
# them as the machine does, so pip, npm and apt inside the builds reach their registries.
LOCAL_CAS="${TRAINBOARD_LOCAL_CAS:-/usr/local/share/ca-certificates}"
cas=()
[ -d "$LOCAL_CAS" ] && while IFS= read -r f; do cas+=("$f"); done < <(find "$LOCAL_CAS" -maxdepth 1 -name '*.crt' -type f | LC_ALL=C sort)

hash="$( (cat "${BASH_SOURCE[0]}"; cd "$ROOT" && find docker/bases -type f | LC_ALL=C sort | xargs cat; \
          [ ${#cas[@]} -eq 0 ] || cat "${cas[@]}") | sha256sum | cut -c1-16)"
tarball="$CACHE/bases-$hash.tar"
mkdir -p "$CACHE"

phase_start=$SECONDS
say() { echo "[docker-bases] $1 ($((SECONDS - phase_start)) s)"; phase_start=$SECONDS; }

present=1
for image in "${IMAGES[@]}"; do
    [ "$(docker image inspect --format '{{index .Config.Labels "trainboard.bases"}}' "$image" 2>/dev/null)" = "$hash" ] \
        || present=0
done
if [ "$present" = 1 ]; then
    say "${IMAGES[*]} already in this engine (bases $hash)"
    exit 0
fi
if [ -s "$tarball" ]; then
    docker load -q -i "$tarball" >/dev/null
    say "loaded ${IMAGES[*]} from $tarball"
    exit 0
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/tb-bases.XXXXXX")"
trap 'rm -rf "$work"' EXIT
command -v debootstrap >/dev/null || { echo "debootstrap missing: run scripts/system-deps.sh" >&2; exit 1; }
debootstrap --variant=minbase bookworm "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
# A slimmer, image-like root: no apt lists or caches, no docs the images never read.
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/usr/share/doc/"* \
       "$work/rootfs/usr/share/man/"*
printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\n' \
    > "$work/rootfs/etc/dpkg/dpkg.cfg.d/01-slim"
# As Debian's official images: no fsync per unpacked file (an image layer is written whole or not at
# all), no package cache kept, no translations fetched.
echo force-unsafe-io > "$work/rootfs/etc/dpkg/dpkg.cfg.d/docker-apt-speedup"
printf 'APT::Keep-Downloaded-Packages "false";\nAcquire::Languages "none";\n' \
    > "$work/rootfs/etc/apt/apt.conf.d/docker-clean"
if [ ${#cas[@]} -gt 0 ]; then
    mkdir -p "$work/rootfs/usr/local/share/ca-certificates"
    cp "${cas[@]}" "$work/rootfs/usr/local/share/ca-certificates/"
fi
say "debootstrap bookworm (minbase), ${#cas[@]} local CA certificate(s)"
tar -C "$work/rootfs" -c . | docker import -c 'CMD ["bash"]' -c "LABEL trainboard.bases=$hash" - \
    trainboard-base/bookworm-rootfs >/dev/null
say "imported trainboard-base/bookworm-rootfs"

for line in "${BASES[@]}"; do
    dir="${line%% *}" tag="${line#* }"
    # Host networking: the build's apt reaches the mirror the way this machine does, no bridge needed.
    docker build -q --network host --label "trainboard.bases=$hash" -t "$tag" "$ROOT/docker/bases/$dir" >/dev/null
    say "built $tag"
done

rm -f "$CACHE"/bases-*.tar
docker save -o "$tarball.tmp" "${IMAGES[@]}"
mv "$tarball.tmp" "$tarball"
say "saved to $tarball ($(du -h "$tarball" | cut -f1))"
