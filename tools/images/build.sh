#!/usr/bin/env bash
# Builds the images of docker/*.Dockerfile without a Docker daemon or a registry, and writes
# each as an OCI image layout: build/images/<name>/ (oci-layout, index.json, blobs/sha256/).
#
#   1. A debian:bookworm-slim stand-in: `debootstrap --variant=minbase` (how Debian's own
#      images start), slimmed the same way (no docs, man pages or locales; apt cleans up),
#      imported once into a buildah store under the cache and kept there.
#   2. `buildah bud` on the unchanged Dockerfile with that base (--build-arg DEBIAN_IMAGE),
#      RUN steps chrooted (no container runtime needed), layers cached in the store, pip's
#      cache shared with the build through a volume.
#   3. `buildah push` to oci:build/images/<name>:<tag>, gzip layers.
#
# Needs root (debootstrap, chroot, overlay mounts) and Debian's buildah, debootstrap;
# as root on Debian it installs those itself. Network: the Debian mirror and PyPI only.
#
# Usage: tools/images/build.sh [--refresh-base] [IMAGE...]   (default: all four)
#   IMAGE: operator, epp, engine, engine-cuda
# Environment:
#   INFERGATE_IMAGES_CACHE  the cache (base rootfs, buildah store, pip cache);
#                           default ~/.cache/infergate/images
#   INFERGATE_IMAGES_OUT    where layouts go; default build/images
#   DEBIAN_MIRROR           default http://deb.debian.org/debian
#   STORAGE_DRIVER          buildah's: overlay (default) or vfs
#   INFERGATE_IMAGES_CA_BUNDLE  a CA bundle pip in the build trusts (default: $PIP_CERT)
#   TORCH_INDEX_URL         the engines' torch index instead of their Dockerfiles' default
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

cache="${INFERGATE_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infergate/images}"
out="${INFERGATE_IMAGES_OUT:-$root/build/images}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm
base_ref=localhost/infergate/debian:$suite-slim
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"

refresh_base=0
images=()
for arg in "$@"; do
  case "$arg" in
    --refresh-base) refresh_base=1 ;;
    operator|epp|engine|engine-cuda) images+=("$arg") ;;
    *) echo "tools/images/build.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
[[ ${#images[@]} -gt 0 ]] || images=(operator epp engine engine-cuda)

die() { echo "tools/images/build.sh: $*" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || die "needs root: debootstrap, chroot and buildah's overlay store do (docs/images.md)"
# buildah and debootstrap build; umoci, runc and skopeo are what tests/images runs them with.
missing=()
for tool in buildah debootstrap umoci runc skopeo; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [[ ${#missing[@]} -gt 0 ]]; then
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  echo "installing ${missing[*]} (apt)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || die "apt-get install ${missing[*]} failed"
fi

store=(--root "$cache/storage" --runroot "$cache/run" --storage-driver "${STORAGE_DRIVER:-overlay}")
bah() { buildah "${store[@]}" "$@"; }
mkdir -p "$cache/pip"
# A machine behind a TLS-intercepting proxy trusts its CA through pip's PIP_CERT: that bundle
# is mounted into the build's RUN steps (never into a layer) and named by the Dockerfiles'
# PIP_CERT build argument.
ca_bundle="${INFERGATE_IMAGES_CA_BUNDLE:-${PIP_CERT:-}}"
ca_args=()
if [[ -n "$ca_bundle" ]]; then
  [[ -f "$ca_bundle" ]] || die "CA bundle $ca_bundle (INFERGATE_IMAGES_CA_BUNDLE or PIP_CERT) is not a file"
  ca_args=(--volume "$ca_bundle:/etc/pip-build-ca.crt:ro" --build-arg PIP_CERT=/etc/pip-build-ca.crt)
fi

# One timestamp for every layer and config: the commit's, so a rebuild of the same commit
# writes the same files and dates.
epoch="$(git log -1 --format=%ct 2>/dev/null || echo 0)"

build_base() {
  local rootfs="$cache/rootfs.tmp"
  rm -rf "$rootfs"
  echo "== base: debootstrap --variant=minbase $suite ($mirror)" >&2
  debootstrap --variant=minbase --components=main "$suite" "$rootfs" "$mirror" >&2 \
    || die "debootstrap failed (log: $rootfs/debootstrap/debootstrap.log)"
  # apt sources as in Debian's images: the release, its updates and security.
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # Slim: dpkg skips documentation, manuals and translations from now on (copyrights stay),
  # and what debootstrap already unpacked of them goes too.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/infergate-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
EOF
  find "$rootfs/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  rm -rf "$rootfs"/usr/share/{man,info,groff,lintian}/*
  # apt keeps no downloaded packages and no binary caches in a layer.
  cat >"$rootfs/etc/apt/apt.conf.d/infergate-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  # The host's files that debootstrap copied in, and its own leftovers.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/* \
    "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/debootstrap "$rootfs"/etc/resolv.conf "$rootfs"/etc/hostname "$rootfs"/tmp/* \
    "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old
  : >"$rootfs/etc/machine-id"

  bah rmi -f "$base_ref" >/dev/null 2>&1 || true
  local ctr mnt
  ctr="$(bah from --name infergate-base-import scratch)"
  mnt="$(bah mount "$ctr")"
  cp -a "$rootfs/." "$mnt/"
  bah umount "$ctr" >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd '["bash"]' --os linux --arch amd64 \
    --label "io.infergate.base=debootstrap --variant=minbase $suite, slimmed (tools/images/build.sh)" \
    "$ctr"
  bah commit --rm --timestamp "$epoch" "$ctr" "$base_ref" >&2
  rm -rf "$rootfs"
}

start=$SECONDS
if [[ $refresh_base == 1 ]] || ! bah inspect --type image "$base_ref" >/dev/null 2>&1; then
  build_base
  echo "== base took $((SECONDS - start))s" >&2
fi

# The CPU engine's torch comes from PyTorch's own index, not PyPI: say so at once if this
# machine cannot reach it (pip would retry for minutes, then report "no matching
# distribution"). TORCH_INDEX_URL overrides the Dockerfiles' index for both engines.
torch_index() {
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then echo "$TORCH_INDEX_URL"; return; fi
  sed -n 's/^ARG TORCH_INDEX_URL=//p' "docker/$1.Dockerfile"
}
for name in "${images[@]}"; do
  [[ "$name" == engine || "$name" == engine-cuda ]] || continue
  index="$(torch_index "$name")"
  python3 - "$index" "$ca_bundle" <<'PY' || die "$name: torch's index $index is unreachable from this machine; set TORCH_INDEX_URL to a mirror, or build engine-cuda (PyPI's torch also runs on CPU) (docs/images.md)"
import ssl, sys, urllib.request
index, cafile = sys.argv[1].rstrip("/"), sys.argv[2] or None
try:
    context = ssl.create_default_context(cafile=cafile)
    urllib.request.urlopen(f"{index}/torch/", timeout=20, context=context).close()
except OSError as error:
    sys.exit(f"{index}/torch/: {error}")
PY
done

report=()
for name in "${images[@]}"; do
  # The engines' config records which index their torch came from.
  torch_args=()
  if [[ "$name" == engine* ]]; then
    torch_args=(--label "io.infergate.torch-index=$(torch_index "$name")")
    [[ -z "${TORCH_INDEX_URL:-}" ]] || torch_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
  fi
  case "$name" in
    engine-cuda) ref="ghcr.io/infergate/engine:$version-cuda" ;;
    *) ref="ghcr.io/infergate/$name:$version" ;;
  esac
  t0=$SECONDS
  echo "== $name: buildah bud -f docker/$name.Dockerfile -> $ref" >&2
  bah bud --isolation chroot --layers --pull=never --timestamp "$epoch" \
    --build-arg "DEBIAN_IMAGE=$base_ref" \
    --volume "$cache/pip:/root/.cache/pip" "${ca_args[@]}" "${torch_args[@]}" \
    --ignorefile "docker/$name.Dockerfile.dockerignore" \
    -f "docker/$name.Dockerfile" -t "$ref" . >&2 \
    || die "buildah bud of docker/$name.Dockerfile failed (see above)"
  t1=$SECONDS
  layout="$out/$name"
  rm -rf "$layout.tmp" && mkdir -p "$out"
  bah push --compression-format gzip --remove-signatures --quiet "$ref" "oci:$layout.tmp:$version" >&2 \
    || die "buildah push of $ref to an OCI layout failed"
  rm -rf "$layout" && mv "$layout.tmp" "$layout"
  size="$(du -sm "$layout" | cut -f1)"
  report+=("$name: $ref -> ${layout#"$root"/} ${size} MiB compressed, bud $((t1 - t0))s, push $((SECONDS - t1))s")
done
printf '%s\n' "${report[@]}"
echo "total $((SECONDS - start))s"
