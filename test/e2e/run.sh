#!/usr/bin/env bash
# Runs the e2e suite (make e2e): installs containerd, runc and busybox-static from Debian when missing, builds
# the kubelet, the control plane and etcd once per version (cached), the pause image's binary and gpu-agent,
# then runs the Go tests.
# Any missing piece is an error: this script never skips. Extra arguments go to `go test` (e.g. -run TestOneGPU).
# E2E_BUILD_ONLY=1 only builds (or finds cached) the Kubernetes binaries and etcd, with no root and no apt, and
# prints their paths as `export E2E_...=...` lines for a shell to eval (make fleet-bench does), so that they
# are built in this one place; E2E_BUILD_ONLY="etcd kube-apiserver kube-scheduler" builds only those (names
# among kubelet, kube-apiserver, kube-controller-manager, kube-scheduler, etcd).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export CGO_CFLAGS="${CGO_CFLAGS:--Wno-deprecated-declarations}"
export E2E_CACHE="${E2E_CACHE:-$HOME/.cache/gpu-agent-e2e}"
mkdir -p "$E2E_CACHE"

die() { echo "e2e: $*" >&2; exit 1; }
step() { echo "e2e: $* ($(date +%T))" >&2; }

build_only="${E2E_BUILD_ONLY:-}"
if [ -z "$build_only" ]; then
	[ "$(id -u)" = 0 ] || die "must run as root: the kubelet and containerd need it"

	# Debian 12 ships containerd 1.6 and runc; busybox-static fills the test image (the plain busybox package is
	# dynamically linked and would not run in an image without libc); containernetworking-plugins gives the
	# reference CNI plugins a Cluster with a pod network runs (harness/podnetwork.go).
	missing=()
	for pkg in containerd runc busybox-static prometheus containernetworking-plugins; do
		dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
	done
	if [ "${#missing[@]}" -gt 0 ]; then
		step "installing ${missing[*]}"
		command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} by hand"
		apt-get update -qq || die "apt-get update failed"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
			|| die "apt-get install ${missing[*]} failed"
	fi
	for bin in containerd ctr runc containerd-shim-runc-v2; do
		command -v "$bin" >/dev/null || die "$bin not found after installing containerd and runc"
	done
fi

# The kubelet and the control plane (kube-apiserver, kube-controller-manager, kube-scheduler) come from the
# k8s.io/kubernetes version pinned in go.mod, etcd from the etcd server module that version requires (the
# module's root package is etcd's main). Building them takes minutes and a few GB of build cache, so each
# binary is kept per version; the missing ones are built in one `go build` per module, which compiles the
# packages they share once and keeps both cores busy. -s -w: no symbol table or DWARF, which make up much of
# linking five large binaries; panics still print their stacks.
# E2E_K8S=1.34 (make e2e-k8s134) takes the kubelet and the control plane from the module in k8s134/ instead,
# for the tests that make sense on the Kubernetes users run today (pass them with -run); etcd stays the
# suite's, a newer patch of the same etcd minor, which the older API server speaks to alike.
k8s_mod="$here"
case "${E2E_K8S:-}" in
"") ;;
1.34) k8s_mod="$here/k8s134" ;;
1.37)
	# Only the fleet benchmark's API server and scheduler (make fleet-bench FLEET_K8S=1.37): k8s137/ builds no
	# kubelet, and the suite's tests are not written for 1.37.
	k8s_mod="$here/k8s137"
	[ -n "$build_only" ] && [ "$build_only" != 1 ] || die "E2E_K8S=1.37 serves only E2E_BUILD_ONLY='etcd kube-apiserver kube-scheduler' (make fleet-bench FLEET_K8S=1.37)"
	for name in $build_only; do
		case "$name" in
		etcd | kube-apiserver | kube-scheduler) ;;
		*) die "E2E_K8S=1.37: $name is not built for 1.37 (only etcd kube-apiserver kube-scheduler)" ;;
		esac
	done
	;;
*) die "E2E_K8S=$E2E_K8S: only 1.34 and 1.37 are known (empty: the version in go.mod)" ;;
esac
version="$(cd "$k8s_mod" && go list -m -f '{{.Version}}' k8s.io/kubernetes)" || die "cannot read the kubelet version from $k8s_mod/go.mod"
etcd_version="$(cd "$here" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)" || die "cannot read the etcd version from go.mod"
kubelet="$E2E_CACHE/kubelet-$version"
apiserver="$E2E_CACHE/kube-apiserver-$version"
controller_manager="$E2E_CACHE/kube-controller-manager-$version"
scheduler="$E2E_CACHE/kube-scheduler-$version"
etcd="$E2E_CACHE/etcd-$etcd_version"
# binary in the cache, the package, the name `go build -o DIR/` gives it, the module to build it in, the
# name E2E_BUILD_ONLY selects it by and the variable the suite reads its path from
builds=(
	"$kubelet k8s.io/kubernetes/cmd/kubelet kubelet $k8s_mod kubelet E2E_KUBELET"
	"$apiserver k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver $k8s_mod kube-apiserver E2E_KUBE_APISERVER"
	"$controller_manager k8s.io/kubernetes/cmd/kube-controller-manager kube-controller-manager $k8s_mod kube-controller-manager E2E_KUBE_CONTROLLER_MANAGER"
	"$scheduler k8s.io/kubernetes/cmd/kube-scheduler kube-scheduler $k8s_mod kube-scheduler E2E_KUBE_SCHEDULER"
	"$etcd go.etcd.io/etcd/server/v3 server $here etcd E2E_ETCD"
)
# wanted: whether this run needs the binary of that name (all of them, unless E2E_BUILD_ONLY names some).
wanted() { [ -z "$build_only" ] || [ "$build_only" = 1 ] || [[ " $build_only " == *" $1 "* ]]; }
if [ -n "$build_only" ] && [ "$build_only" != 1 ]; then
	for name in $build_only; do
		case "$name" in
		kubelet | kube-apiserver | kube-controller-manager | kube-scheduler | etcd) ;;
		*) die "E2E_BUILD_ONLY: unknown name $name; want 1, or names among kubelet kube-apiserver kube-controller-manager kube-scheduler etcd" ;;
		esac
	done
fi
for mod in "$k8s_mod" "$here"; do
	pkgs=()
	for b in "${builds[@]}"; do
		read -r bin pkg _ dir key _ <<<"$b"
		[ "$dir" = "$mod" ] && [ ! -x "$bin" ] && wanted "$key" && pkgs+=("$pkg")
	done
	[ "${#pkgs[@]}" -gt 0 ] || continue
	step "building ${pkgs[*]##*/cmd/} in ${mod#"$repo"/} (k8s.io/kubernetes $version, etcd $etcd_version; cold, all five: about 4 minutes on 2 cores after make lint, which compiles most of their packages to vet this module, about 25 from nothing)"
	out="$(mktemp -d "$E2E_CACHE/build.XXXXXX")"
	(cd "$mod" && CGO_ENABLED=0 nice -n 10 go build \
		-ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$version" \
		-o "$out/" "${pkgs[@]}") || { rm -rf "$out"; die "build of ${pkgs[*]} failed"; }
	for b in "${builds[@]}"; do
		read -r bin _ name dir _ <<<"$b"
		if [ "$dir" = "$mod" ] && [ -e "$out/$name" ]; then mv "$out/$name" "$bin"; fi
	done
	rm -rf "$out"
done

if [ -n "$build_only" ]; then
	for b in "${builds[@]}"; do
		read -r bin _ _ _ key var <<<"$b"
		if wanted "$key"; then printf 'export %s=%q\n' "$var" "$bin"; fi
	done
	printf 'export E2E_K8S_VERSION=%q\n' "$version"
	exit 0
fi

# containerd 2.x for the CDI scenarios (Debian 12's containerd 1.6 has no CDI; the other scenarios keep it):
# containerd, its runc shim and ctr from the version pinned in containerd2/go.mod, built once per version
# (about 3 minutes cold on 2 cores).
ctrd_version="$(cd "$here/containerd2" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)" \
	|| die "cannot read the containerd version from containerd2/go.mod"
ctrd_dir="$E2E_CACHE/containerd-$ctrd_version"
if [ ! -x "$ctrd_dir/containerd" ] || [ ! -x "$ctrd_dir/containerd-shim-runc-v2" ] || [ ! -x "$ctrd_dir/ctr" ]; then
	step "building containerd $ctrd_version"
	out="$(mktemp -d "$E2E_CACHE/build.XXXXXX")"
	(cd "$here/containerd2" && CGO_ENABLED=0 nice -n 10 go build -tags "no_btrfs no_devmapper no_zfs" \
		-ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=${ctrd_version#v}" -o "$out/" \
		github.com/containerd/containerd/v2/cmd/containerd \
		github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
		github.com/containerd/containerd/v2/cmd/ctr) || { rm -rf "$out"; die "build of containerd $ctrd_version failed"; }
	rm -rf "$ctrd_dir" && mv "$out" "$ctrd_dir"
fi
export E2E_CONTAINERD2="$ctrd_dir"

step "building pause and gpu-agent"
(cd "$here" && CGO_ENABLED=0 go build -o "$E2E_CACHE/pause" ./cmd/pause) || die "pause build failed"
if [ -z "${E2E_GPU_AGENT:-}" ]; then
	E2E_GPU_AGENT="$E2E_CACHE/gpu-agent"
	(cd "$repo" && go build -o "$E2E_GPU_AGENT" ./cmd/gpu-agent) || die "gpu-agent build failed"
fi

export E2E_KUBELET="$kubelet" E2E_GPU_AGENT E2E_PAUSE="$E2E_CACHE/pause" E2E_BUSYBOX="${E2E_BUSYBOX:-/bin/busybox}"
export E2E_KUBE_APISERVER="$apiserver" E2E_KUBE_CONTROLLER_MANAGER="$controller_manager" E2E_KUBE_SCHEDULER="$scheduler" \
	E2E_ETCD="$etcd"
# The tests of k8s134_test.go (build tag k8s134) check what only an older API server does.
tags=e2e
if [ -n "${E2E_K8S:-}" ]; then tags="e2e,k8s${E2E_K8S//./}"; fi
export E2E_K8S="${E2E_K8S:-}" E2E_K8S_VERSION="$version"
step "running the suite (Kubernetes $version)"
cd "$here"
# Without cgo, as the Kubernetes binaries above are built (and as make lint vets this module): the suite's
# compile is then the packages those builds already compiled, not a second compile of half of Kubernetes
# with cgo (about 10 minutes of a cold run on 2 cores). Nothing here needs cgo; gpu-agent, which does, is
# built above in its own module.
CGO_ENABLED=0 exec go test -tags "$tags" -count=1 -v -timeout 20m ./... "$@"
