package config

import (
	"errors"
	"fmt"

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// MaxBytes is the largest config this package reads. The file is delivered
// as a ConfigMap key, and the API server refuses a ConfigMap whose data
// exceeds 1 MiB, so nothing legitimate is larger; a bigger input is a
// mistake or an attack, and parsing costs memory in proportion to its size.
const MaxBytes = 1 << 20

// MaxReplicas bounds replicas of one time-slicing or MPS entry. Every
// replica is a device ID held in the catalog and sent in full on each
// ListAndWatch update, so the bound keeps that list (devices × replicas)
// within one gRPC message at the default 4 MiB limit even on a node of 56
// MIG devices (8 GPUs × 7), about 66 bytes a replica on the wire. 1024 is
// still far above any useful value: sharing
// one device between more containers than a node runs pods (the kubelet's
// default maxPods is 110) buys nothing, and MPS serves at most 48 clients
// per GPU.
const MaxReplicas = 1024

// ReadFile reads a config file of at most MaxBytes, following symlinks (a
// mounted ConfigMap key is one). Anything but a regular file is refused
// without reading from it (atomicfile.ReadFile): a FIFO would block the
// reader, and a device such as /dev/zero never ends.
func ReadFile(path string) ([]byte, error) {
	data, err := atomicfile.ReadFile(path, MaxBytes)
	switch {
	case errors.Is(err, atomicfile.ErrNotRegular):
		return nil, fmt.Errorf("config %s: %v; only regular files of at most %d bytes are read", path, err, MaxBytes)
	case errors.Is(err, atomicfile.ErrTooLarge):
		return nil, fmt.Errorf("config %s: %v (a ConfigMap's limit)", path, err)
	case err != nil:
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return data, nil
}
