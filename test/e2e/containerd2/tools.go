//go:build tools

// Package containerd2 pins the containerd 2.x the e2e suite builds for its
// CDI scenarios (Debian 12's containerd 1.6 has no CDI): run.sh builds
// containerd, its runc shim and ctr from this module, so the version is the
// one in go.mod and the build is cached per version like the kubelet's.
package containerd2

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
